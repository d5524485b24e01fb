"""The stand-in libnvidia-ml.so.1 (tests/nvml_standin.c) that the real nvidia-ml-py loads in the
tests of MIG and of memory accounting, and the state file that drives it.

`build(directory)` compiles it as `directory/libnvidia-ml.so.1` (once per source: a second call
reuses it); a child with `LD_LIBRARY_PATH=directory` and `NVML_STANDIN_STATE=<state file>` then
sees the GPUs `State` describes through `import pynvml`.  Whatever loads it runs in a child
process: pynvml binds its library once per process.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from memtop.sources.driver_libraries import DEV_DIR_ENV

SOURCE = Path(__file__).with_name("nvml_standin.c")
STATE_ENV = "NVML_STANDIN_STATE"
GiB = 1 << 30
MiB = 1 << 20
# What the stand-in keeps out of a whole GPU's `used` as nvmlMemory_v2's `reserved`.
RESERVED = 512 * MiB


def build(directory: Path) -> Path:
    """The folder holding the stand-in as libnvidia-ml.so.1 (world-readable: a user's memtop
    loads it too)."""
    key = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    lib = directory / "libnvidia-ml.so.1"
    stamp = directory / "built-from"
    if lib.exists() and stamp.exists() and stamp.read_text() == key:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / "libnvidia-ml.so.1.tmp"
    subprocess.run(
        ["cc", "-O1", "-shared", "-fPIC", "-Wall", "-o", str(temporary), str(SOURCE)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    os.replace(temporary, lib)
    stamp.write_text(key)
    for path in (directory, lib, stamp):
        path.chmod(0o755 if path.is_dir() or path == lib else 0o644)
    return directory


def gpu_uuid(index: int) -> str:
    return f"GPU-fa4e0000-0000-4000-8000-{index:012d}"


def mig_uuid(parent: int, gpu_instance: int, compute_instance: int = 0) -> str:
    return f"MIG-5a1e{parent:04d}-00{gpu_instance:02d}-4000-8000-{compute_instance:012d}"


def pci_bus_id(index: int) -> str:
    return f"0000:{0x18 + index:02x}:00.0"


@dataclass
class Gpu:
    total: int = 80 * GiB
    used: int = 10 * GiB  # as nvmlMemory_t counts it (v2's used is this less RESERVED)
    util: int = 50
    name: str = "NVIDIA A100-SXM4-80GB"


@dataclass
class Mig:
    parent: int
    gpu_instance: int
    compute_instance: int = 0
    total: int = 40 * GiB
    used: int = 0
    profile: str = "3g.40gb"
    name: str | None = None  # None: "<parent's name> MIG <profile>"


@dataclass
class State:
    gpus: list[Gpu] = field(default_factory=list)
    migs: list[Mig] = field(default_factory=list)
    processes: list[tuple[int, int, int]] = field(default_factory=list)  # (gpu, pid, used)
    # (parent, gpu instance, compute instance, pid, used)
    mig_processes: list[tuple[int, int, int, int, int]] = field(default_factory=list)

    def text(self) -> str:
        lines = [f"gpu {i} {g.total} {g.used} {g.util} {g.name}" for i, g in enumerate(self.gpus)]
        for m in self.migs:
            name = m.name if m.name is not None else f"{self.gpus[m.parent].name} MIG {m.profile}"
            lines.append(
                f"mig {m.parent} {m.gpu_instance} {m.compute_instance} {m.total} {m.used} {name}"
            )
        lines += [f"proc {gpu} {pid} {used}" for gpu, pid, used in self.processes]
        lines += [
            f"migproc {p} {gi} {ci} {pid} {used}" for p, gi, ci, pid, used in self.mig_processes
        ]
        return "\n".join(lines) + "\n"

    def write(self, path: Path) -> Path:
        temporary = path.with_suffix(".tmp")
        temporary.write_text(self.text())
        os.replace(temporary, path)
        path.chmod(0o644)
        return path


def env(library: Path, state: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment in which pynvml loads the stand-in driven by `state`."""
    result = dict(os.environ if base is None else base)
    result["LD_LIBRARY_PATH"] = str(library)
    result[STATE_ENV] = str(state)
    # As root, memtop loads NVML only where a /dev/nvidia* node exists (driver_libraries): the
    # stand-in's box has none, so the tests say where its "device node" is (tests only).
    dev = Path(library) / "dev"
    dev.mkdir(exist_ok=True)
    (dev / "nvidia0").touch()
    result[DEV_DIR_ENV] = str(dev)
    return result
