"""The stand-in libamd_smi.so of the AMD tests, built from the installed `amdsmi` package.

`build(directory)` compiles tests/amd_standin.c into `directory/lib/libamd_smi.so`, so that
`ROCM_PATH=directory` makes the real amdsmi package load it.  Its structures come from amdsmi's
own ctypes wrapper: a first, stub-only library lets a child Python import the package and dump
every offset, size, bit position and status code the C source uses (standin_layout.h); the
second build is the stand-in proper, with a NOT_SUPPORTED stub for every other function the
wrapper binds at import.  `State` writes the state file that drives it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).parent
SOURCE = HERE / "amd_standin.c"
STATE_ENV = "AMD_SMI_STANDIN_STATE"

# What standin_layout.h holds: (macro prefix, wrapper struct) flattened to L_<prefix>_<field>.
STRUCTS = {
    "asic": "struct_amdsmi_asic_info_t",
    "driver": "struct_amdsmi_driver_info_t",
    "engine": "struct_amdsmi_engine_usage_t",
    "power": "struct_amdsmi_power_info_t",
    "proc": "struct_amdsmi_proc_info_t",
}
CONSTANTS = {
    "K_PROCESSOR_TYPE_AMD_GPU": "AMDSMI_PROCESSOR_TYPE_AMD_GPU",
    "K_MEM_TYPE_VRAM": "AMDSMI_MEM_TYPE_VRAM",
    "K_TEMPERATURE_TYPE_HOTSPOT": "AMDSMI_TEMPERATURE_TYPE_HOTSPOT",
    "K_TEMP_CURRENT": "AMDSMI_TEMP_CURRENT",
}

# Run in a child against the stub library: prints standin_layout.h.
_DUMP = r"""
import ctypes, sys
from amdsmi import amdsmi_wrapper as w
structs, constants = eval(sys.argv[1]), eval(sys.argv[2])
out = []
def walk(prefix, cls, base):
    for spec in cls._fields_:
        name, kind = spec[0], spec[1]
        if name.startswith("PADDING"):
            continue
        f = getattr(cls, name)
        if isinstance(kind, type) and issubclass(kind, ctypes.Structure):
            walk(f"{prefix}_{name}", kind, base + f.offset)
        else:
            out.append(f"#define L_{prefix}_{name} {base + f.offset}")
            out.append(f"#define L_{prefix}_{name}_SIZE {ctypes.sizeof(kind)}")
for prefix, struct in structs.items():
    cls = getattr(w, struct)
    walk(prefix, cls, 0)
    out.append(f"#define L_{prefix}__SIZE {ctypes.sizeof(cls)}")
shift = 0
for spec in w.struct_amdsmi_bdf_t._fields_:  # bit fields of one uint64, lowest first
    out.append(f"#define K_BDF_SHIFT_{spec[0]} {shift}")
    shift += spec[2]
for macro, name in constants.items():
    out.append(f"#define {macro} {getattr(w, name)}")
for name in dir(w):
    if name.startswith("AMDSMI_STATUS_"):
        out.append(f"#define S_{name[len('AMDSMI_STATUS_'):]} {getattr(w, name)}u")
print("\n".join(out))
"""


def wrapper_path() -> Path:
    """The installed amdsmi package's amdsmi_wrapper.py (found without importing it: the import
    needs the library)."""
    spec = importlib.util.find_spec("amdsmi")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the amdsmi package is not installed (pip install -e '.[test]')")
    return Path(next(iter(spec.submodule_search_locations))) / "amdsmi_wrapper.py"


def _bound_functions(wrapper: Path) -> list[str]:
    text = wrapper.read_text(encoding="utf-8")
    return sorted(set(re.findall(r"_libraries\['libamd_smi\.so'\]\.(\w+)", text)))


def _compile(out: Path, *sources: Path, include: Path | None = None) -> None:
    command = ["cc", "-O1", "-shared", "-fPIC", "-Wall", "-o", str(out), *map(str, sources)]
    if include is not None:
        command[1:1] = ["-I", str(include)]
    subprocess.run(command, check=True, capture_output=True, timeout=120)


def build(directory: Path) -> Path:
    """The stand-in as `directory/lib/libamd_smi.so` (built once per package and source: a
    second call with the same directory reuses it).  Returns `directory`, the ROCM_PATH."""
    wrapper = wrapper_path()
    key = hashlib.sha256(wrapper.read_bytes() + SOURCE.read_bytes()).hexdigest()[:16]
    lib = directory / "lib" / "libamd_smi.so"
    stamp = directory / "built-from"
    if lib.exists() and stamp.exists() and stamp.read_text() == key:
        return directory
    work = directory / "build"
    shutil.rmtree(work, ignore_errors=True)
    (work / "stub" / "lib").mkdir(parents=True)
    (directory / "lib").mkdir(parents=True, exist_ok=True)
    # Weak NOT_SUPPORTED stubs for every symbol the wrapper binds: the stand-in's own
    # definitions, in another translation unit, win at link time.
    stubs = work / "standin_stubs.c"
    not_supported = 2  # AMDSMI_STATUS_NOT_SUPPORTED; checked against the layout below
    stubs.write_text(
        "".join(
            f"__attribute__((weak)) unsigned {name}(void) {{ return {not_supported}; }}\n"
            for name in _bound_functions(wrapper)
        )
    )
    _compile(work / "stub" / "lib" / "libamd_smi.so", stubs)
    env = dict(os.environ, ROCM_PATH=str(work / "stub"))
    env.pop("ROCM_HOME", None)
    dumped = subprocess.run(
        [sys.executable, "-c", _DUMP, repr(STRUCTS), repr(CONSTANTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if dumped.returncode != 0:
        raise RuntimeError(f"reading amdsmi's ctypes layout failed:\n{dumped.stderr}")
    layout = dumped.stdout
    if f"#define S_NOT_SUPPORTED {not_supported}u" not in layout:
        raise RuntimeError("amdsmi's NOT_SUPPORTED status changed: update the stubs")
    (work / "standin_layout.h").write_text(layout)
    _compile(work / "libamd_smi.so", SOURCE, stubs, include=work)
    os.replace(work / "libamd_smi.so", lib)
    stamp.write_text(key)
    return directory


@dataclass
class Gpu:
    total: int = 192 << 30
    used: int = 8 << 30
    util: int = 50
    bdf: str = "0000:c1:00.0"
    uuid: str = "c1ff74a1-0000-1000-80c1-000000000000"
    name: str = "AMD Instinct MI300X"
    lost: bool = False
    deny_processes: bool = False


@dataclass
class State:
    """The stand-in's state file: GPUs, their processes' VRAM, and the failure states."""

    gpus: list[Gpu] = field(default_factory=list)
    processes: list[tuple[int, int, int]] = field(default_factory=list)  # (gpu, pid, vram)
    init_status: int = 0

    def text(self) -> str:
        lines = [f"init {self.init_status}"] if self.init_status else []
        for i, g in enumerate(self.gpus):
            lines.append(f"gpu {i} {g.total} {g.used} {g.util} {g.bdf} {g.uuid} {g.name}")
            if g.lost:
                lines.append(f"lost {i}")
            if g.deny_processes:
                lines.append(f"deny_processes {i}")
        lines += [f"proc {gpu} {pid} {vram}" for gpu, pid, vram in self.processes]
        return "\n".join(lines) + "\n"

    def write(self, path: Path) -> Path:
        temporary = path.with_suffix(".tmp")
        temporary.write_text(self.text())
        os.replace(temporary, path)
        return path


def mi300x(count: int, used: int = 8 << 30) -> list[Gpu]:
    """`count` MI300X GPUs at bus addresses 0000:{0c,22,38,...}:00.0, as on an 8-GPU node."""
    return [
        Gpu(
            used=used,
            util=40 + 7 * i,
            bdf=f"0000:{0x0C + 0x16 * i:02x}:00.0",
            uuid=f"{0x0C + 0x16 * i:02x}ff74a1-0000-1000-8000-{i:012x}",
        )
        for i in range(count)
    ]
