"""Which driver library file memtop would load (NVML's, amdsmi's), and whether it may, as root.

Loading a shared library runs its constructors.  Root's `memtop --once`, with a user's
`libamd_smi.so` on ROCM_PATH or LD_LIBRARY_PATH, ran that file's constructor as uid 0 on a box
with no AMD GPU at all.  So, as root (another user's memtop loads what its own environment
says, as that user):
- the library is looked for where the vendor's bindings would find it (amdsmi: $ROCM_HOME,
  $ROCM_PATH, /opt/rocm; NVML: the dynamic linker's path: LD_LIBRARY_PATH, ld.so.conf, the
  system's folders), without loading anything;
- it is loaded only where the vendor's device nodes exist (/dev/nvidia*, /dev/kfd): without
  them there is no GPU of that vendor to read;
- and only when the file and every folder above it are root's and no one else may write them
  (memtop.base.untrusted.root_may_not_load); it is then loaded by that absolute path, first, so
  that the bindings' own lookup gets that very file.
Each refusal is one line (DriverLibraryRefused), shown where the reading's error goes.

The device nodes are looked for in /dev, or in the folder MEMTOP_TEST_DEV_DIR names: a seam for
the tests only (a stand-in library on a box without the vendor's GPU), named as such.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from memtop.base.untrusted import root_may_not_load

DEV_DIR_ENV = "MEMTOP_TEST_DEV_DIR"  # tests only: where the device nodes are looked for
NVML_NAME = "libnvidia-ml.so.1"
AMDSMI_NAME = "libamd_smi.so"
_SYSTEM_DIRS = (
    "/lib",
    "/usr/lib",
    "/lib64",
    "/usr/lib64",
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
)


class DriverLibraryRefused(Exception):
    """The library is there, but memtop does not load it: one line saying why."""


def as_root() -> bool:
    return os.geteuid() == 0


def checked_nvml(environ: Mapping[str, str] | None = None) -> str | None:
    """As root: NVML's library as the linker would find it, checked and loaded (its path), or
    None when there is none where the linker looks (the caller must then not let the bindings
    look for it by name: they would load what the linker finds, unchecked, e.g. through an
    RPATH; it says the library is missing).  Raises DriverLibraryRefused.  Not root: None, and
    nothing is checked."""
    if not as_root():
        return None
    environ = os.environ if environ is None else environ
    # Each folder's glibc-hwcaps subfolders first, as the linker looks: a user's file in one of
    # them was loaded by name, unchecked, where the folders themselves held none.
    folders = [f for d in linker_dirs(environ) for f in (*_searched_in(d)[1:], d)]
    path = next((p for p in _in_dirs(NVML_NAME, folders) if os.path.isfile(p)), None)
    if path is None:
        return None  # (the caller then lets nothing look for it by name: NvmlSource)
    nodes = sorted(glob.glob(str(_dev_dir(environ) / "nvidia*")))
    if not nodes:
        raise DriverLibraryRefused(
            f"NVML not loaded: {path} is there but no {_dev_dir(environ)}/nvidia* device is "
            "(no NVIDIA driver running); memtop does not load a driver library as root where "
            "there is no GPU to read"
        )
    return _load(path, "NVML")


# The dynamic linker's cache of the libraries in ld.so.conf's folders (ldconfig).
LD_SO_CACHE = Path("/etc/ld.so.cache")


def nvml_absent(environ: Mapping[str, str] | None = None) -> bool:
    """Whether NVML surely cannot be read here: no NVIDIA device node (/dev/nvidia*), and no
    libnvidia-ml.so.1 where the dynamic linker would find one (its cache, LD_LIBRARY_PATH, the
    system's folders, each with its glibc-hwcaps subfolders; this Python's lib folders, which
    an RPATH of the interpreter may name; loaded in this process already).  Then the NVML
    bindings need not be imported: on a box without NVIDIA (a demo's), importing pynvml only to
    hear that the library is missing cost ~20 ms of the first reading, before the GPUs' rows,
    and ~3 MB of the dashboard's memory.

    Only names are looked for (stat, a directory listing, the cache's bytes): nothing is loaded,
    resolved or run, as root or not.  Any doubt (a device node, a file found, a cache that
    cannot be read) says False, and the bindings are imported and look for themselves, as they
    always did."""
    environ = os.environ if environ is None else environ
    if glob.glob(str(_dev_dir(environ) / "nvidia*")) or _in_linker_cache(NVML_NAME):
        return False
    folders = [d for d in environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    folders += _SYSTEM_DIRS
    folders += sorted({os.path.join(p, "lib") for p in (sys.prefix, sys.base_prefix)})
    for folder in dict.fromkeys(folders):
        if any(os.path.exists(os.path.join(f, NVML_NAME)) for f in _searched_in(folder)):
            return False
    return not _mapped_here(NVML_NAME)


def _searched_in(folder: str) -> list[str]:
    """`folder` and the hardware-capability subfolders the linker searches in it."""
    hwcaps = os.path.join(folder, "glibc-hwcaps")
    try:
        return [folder, *(os.path.join(hwcaps, name) for name in sorted(os.listdir(hwcaps))[:64])]
    except OSError:
        return [folder]


def _in_linker_cache(name: str) -> bool:
    """Whether the linker's cache (ldconfig's, of ld.so.conf's folders) lists a library of that
    name; True when the cache cannot be read (doubt: let the bindings look)."""
    try:
        data = LD_SO_CACHE.read_bytes()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    # Its entries' names end in NUL: on their own, or as the end of their path (ldconfig's
    # newer cache shares one string for both).
    entry = name.encode() + b"\0"
    return b"\0" + entry in data or b"/" + entry in data


def _mapped_here(name: str) -> bool:
    """Whether a library of that file name is loaded in this process (the linker then hands it
    out whatever the folders hold)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return any(line.rstrip().endswith(b"/" + name.encode()) for line in maps)
    except OSError:
        return False


def checked_amdsmi(environ: Mapping[str, str] | None = None) -> str | None:
    """As root: the libamd_smi.so that the amdsmi package would load first ($ROCM_HOME/lib,
    $ROCM_PATH/lib, /opt/rocm/lib), checked and loaded (ROOT/lib/libamd_smi.so), or None
    when none is there.  Raises DriverLibraryRefused.  Not root: None, and nothing is checked.

    Only those three: the package's next tries (the linker's path, its own folder) are not
    taken as root; the caller points ROCM_HOME at the checked one while it imports amdsmi."""
    if not as_root():
        return None
    environ = os.environ if environ is None else environ
    roots = [environ.get("ROCM_HOME"), environ.get("ROCM_PATH"), "/opt/rocm"]
    candidates = [os.path.join(root, "lib", AMDSMI_NAME) for root in roots if root]
    path = next((p for p in candidates if os.path.isfile(p)), None)
    if path is None:
        return None
    kfd = _dev_dir(environ) / "kfd"
    if not kfd.exists():
        raise DriverLibraryRefused(
            f"amdsmi not loaded: {path} is there but {kfd} is not (no AMD GPU driver running); "
            "memtop does not load a driver library as root where there is no GPU to read"
        )
    return _load(path, "amdsmi")


def _load(path: str, what: str) -> str:
    why = root_may_not_load(path)
    if why is not None:
        raise DriverLibraryRefused(
            f"{what} not loaded: {path} could run another user's code as root ({why}); "
            "as root memtop loads driver libraries only from root's own folders"
        )
    try:
        # By its absolute path: the bindings' own lookup then finds this file loaded already.
        ctypes.CDLL(os.path.realpath(path))
    except OSError as exc:
        raise DriverLibraryRefused(f"{what} not loaded: {path}: {exc}") from None
    return path


def linker_dirs(environ: Mapping[str, str]) -> list[str]:
    """The folders the dynamic linker looks in for a library named without a slash, in its
    order: LD_LIBRARY_PATH, the folders of /etc/ld.so.conf (and what it includes), then the
    system's."""
    dirs = [d for d in environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    dirs += _ld_so_conf(Path("/etc/ld.so.conf"), depth=0)
    dirs += _SYSTEM_DIRS
    return list(dict.fromkeys(dirs))


def _ld_so_conf(conf: Path, depth: int) -> list[str]:
    try:
        lines = conf.read_text(errors="replace").splitlines()[:1000]
    except OSError:
        return []
    dirs: list[str] = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line.startswith("include ") and depth < 4:
            pattern = line.split(None, 1)[1].strip()
            if not os.path.isabs(pattern):
                pattern = str(conf.parent / pattern)
            for included in sorted(glob.glob(pattern))[:100]:
                dirs += _ld_so_conf(Path(included), depth + 1)
        elif line.startswith("/"):
            dirs.append(line)
    return dirs


def _in_dirs(name: str, dirs: list[str]) -> list[str]:
    return [os.path.join(d, name) for d in dirs]


def _dev_dir(environ: Mapping[str, str]) -> Path:
    return Path(environ.get(DEV_DIR_ENV) or "/dev")
