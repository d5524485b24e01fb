"""As root, a driver library another user controls is not loaded (issue 36, item 7).

With a user's `libamd_smi.so` on ROCM_PATH (or a `libnvidia-ml.so.1` on LD_LIBRARY_PATH), root's
`memtop --once` loaded it, and its constructor ran as uid 0, on a box with no AMD GPU.  Here the
stand-in libraries do nothing but write a line when loaded; a real local user owns them; root
runs `memtop --once`: no line may appear, and memtop says in one line why it did not load them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from local_users import LocalUser, local_user, needs_root

from memtop.sources.driver_libraries import DEV_DIR_ENV, linker_dirs

pytestmark = [
    pytest.mark.slow,
    needs_root,
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler for the stand-ins"),
]

PLANTED = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "a");
    if (f) { fprintf(f, "%s loaded with euid %d\n", NAME, (int)geteuid()); fclose(f); }
}
"""


@dataclass
class Planted:
    user: LocalUser
    rocm: Path  # ROCM_PATH: rocm/lib/libamd_smi.so
    libs: Path  # LD_LIBRARY_PATH: libs/libnvidia-ml.so.1
    dev: Path  # a folder holding stand-ins for /dev/kfd and /dev/nvidia0
    marker: Path

    def lines(self) -> list[str]:
        return self.marker.read_text().splitlines() if self.marker.exists() else []


def _compile(source: Path, out: Path, name: str, marker: Path) -> None:
    subprocess.run(
        ["cc", "-shared", "-fPIC", f'-DMARKER="{marker}"', f'-DNAME="{name}"', "-o", str(out),
         str(source)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def planted() -> Iterator[Planted]:
    work = Path(tempfile.mkdtemp(prefix="mtlib-", dir="/tmp"))
    work.chmod(0o755)
    try:
        with local_user("mtlib") as user:
            marker = work / "marker"
            marker.touch()
            marker.chmod(0o666)
            source = work / "planted.c"
            source.write_text(PLANTED)
            rocm, libs, dev = work / "rocm", work / "libs", work / "dev"
            (rocm / "lib").mkdir(parents=True)
            libs.mkdir()
            dev.mkdir()
            (dev / "kfd").touch()
            (dev / "nvidia0").touch()
            _compile(source, rocm / "lib" / "libamd_smi.so", "libamd_smi.so", marker)
            _compile(source, libs / "libnvidia-ml.so.1", "libnvidia-ml.so.1", marker)
            for path in (rocm, rocm / "lib", rocm / "lib" / "libamd_smi.so", libs,
                         libs / "libnvidia-ml.so.1"):  # fmt: skip
                os.chown(path, user.uid, user.gid)
            yield Planted(user, rocm, libs, dev, marker)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def once(planted: Planted, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if k not in ("ROCM_HOME", DEV_DIR_ENV)}
    full.update(env)
    done = subprocess.run(
        [sys.executable, "-m", "memtop", "--once"],
        capture_output=True,
        text=True,
        env=full,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_no_amd_gpu_no_libamd_smi_loaded_as_root(planted: Planted) -> None:
    said = once(planted, ROCM_PATH=str(planted.rocm))
    assert planted.lines() == []
    assert f"amdsmi not loaded: {planted.rocm}/lib/libamd_smi.so is there but /dev/kfd" in said


def test_another_users_libamd_smi_is_refused_where_the_gpu_is(planted: Planted) -> None:
    said = once(planted, ROCM_PATH=str(planted.rocm), **{DEV_DIR_ENV: str(planted.dev)})
    assert planted.lines() == []
    assert "amdsmi not loaded: " in said
    assert f"belongs to uid {planted.user.uid}, not root" in said


def test_another_users_nvml_on_ld_library_path_is_refused(planted: Planted) -> None:
    env = {"LD_LIBRARY_PATH": str(planted.libs), "ROCM_PATH": "/nonexistent-rocm"}
    said = once(planted, **env)
    assert planted.lines() == []
    assert f"NVML not loaded: {planted.libs}/libnvidia-ml.so.1 is there but no /dev/nvidia" in said
    said = once(planted, **env, **{DEV_DIR_ENV: str(planted.dev)})
    assert planted.lines() == []
    assert f"belongs to uid {planted.user.uid}, not root" in said


def test_the_linker_path_starts_with_ld_library_path() -> None:
    dirs = linker_dirs({"LD_LIBRARY_PATH": "/a::/b"})
    assert dirs[:2] == ["/a", "/b"] and "/usr/lib" in dirs


def test_another_users_nvml_in_a_hwcaps_folder_of_ld_library_path_is_never_loaded(
    planted: Planted, tmp_path: Path
) -> None:
    # The dynamic linker looks in each LD_LIBRARY_PATH folder's glibc-hwcaps/<level>/ before the
    # folder itself.  Root's check looked in the folders only: finding nothing there, it let
    # pynvml's nvmlInit look by name, and the linker loaded the user's file from the subfolder.
    # As root, memtop now loads NVML only from a file it checked, and lets nothing else look.
    user = planted.user
    libs = tmp_path / "hwlibs"
    level = libs / "glibc-hwcaps" / "x86-64-v2"
    level.mkdir(parents=True)
    shutil.copy(planted.libs / "libnvidia-ml.so.1", level / "libnvidia-ml.so.1")
    tmp_path.chmod(0o755)
    for path in (libs, libs / "glibc-hwcaps", level, level / "libnvidia-ml.so.1"):
        os.chown(path, user.uid, user.gid)
    env = {"LD_LIBRARY_PATH": str(libs), "ROCM_PATH": "/nonexistent-rocm"}
    said = once(planted, **env, **{DEV_DIR_ENV: str(planted.dev)})
    assert planted.lines() == []
    assert "NVML not loaded: " in said and "could run another user's code as root" in said, said
