"""A socket directory someone else took (issue 27, note 10): anyone can make /tmp/memtop-<uid>
before its user does (where XDG_RUNTIME_DIR is unset).  memtop fails safe, and its one line says
what to do about it."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from local_users import local_user, needs_root

from memtop import protocol

ROOT = Path(__file__).resolve().parent.parent
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")
WHAT_TO_DO = (
    "set XDG_RUNTIME_DIR (your login session's /run/user/<uid>), or MEMTOP_SOCKET_DIR to a "
    "directory you own with mode 0700"
)


def test_a_file_where_the_directory_goes_says_what_to_do(tmp_path: Path) -> None:
    squatted = tmp_path / "memtop-1000"
    squatted.write_text("")
    with pytest.raises(protocol.UnsafeSocketDir) as refusal:
        protocol.ensure_socket_dir(squatted)
    assert str(refusal.value).endswith(WHAT_TO_DO) and "\n" not in str(refusal.value)


def test_a_writable_directory_of_ones_own_says_chmod(tmp_path: Path) -> None:
    mine = tmp_path / "sockets"
    mine.mkdir()
    mine.chmod(0o777)
    with pytest.raises(protocol.UnsafeSocketDir, match=r"expected 700 \(chmod 700 "):
        protocol.ensure_socket_dir(mine)


@needs_root
@pytest.mark.slow
@pytest.mark.skipif(
    SYSTEM_PYTHON is None
    or shutil.which("unshare") is None
    or shutil.which("setpriv") is None
    or not Path("/var/tmp").is_dir(),
    reason="needs python3, unshare, setpriv and /var/tmp",
)
def test_a_users_agent_in_a_squatted_tmp_says_what_to_do() -> None:
    # A private mount namespace with a /tmp of its own: the real /tmp/memtop-* are not touched.
    # There root (the squatter) makes /tmp/memtop-<uid> first; then the user's trainer starts
    # its agent with neither XDG_RUNTIME_DIR nor MEMTOP_SOCKET_DIR set.
    # The checkout may itself live under /tmp (a CI clone), which the namespace's own /tmp
    # hides: the agent's package (standard library only) is copied outside /tmp for the user.
    outside = Path(tempfile.mkdtemp(prefix="mtsq-", dir="/var/tmp"))
    outside.chmod(0o755)
    shutil.copytree(ROOT / "memtop", outside / "memtop", ignore=shutil.ignore_patterns("*.pyc"))
    for path in outside.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    program = (
        f"import sys; sys.path.append({str(outside)!r}); import memtop; "
        "memtop.start_agent(quiet=False)"
    )
    with local_user("mtsqt") as user, contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, outside, ignore_errors=True)
        script = (
            "mount -t tmpfs -o mode=1777 tmpfs /tmp && "
            f"mkdir -m 700 {protocol.socket_dir({}, user.uid)} && "
            f"exec setpriv --reuid={user.uid} --regid={user.gid} --clear-groups "
            f'env -i PATH=/usr/bin:/bin {SYSTEM_PYTHON} -c "$0"'
        )
        result = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, program],
            capture_output=True,
            text=True,
            timeout=60,
        )
    if "unshare failed" in result.stderr or "mount:" in result.stderr:
        pytest.skip(f"no private mount namespace here: {result.stderr.strip()}")
    lines = [line for line in result.stderr.splitlines() if "memtop" in line]
    assert len(lines) == 1, result.stderr
    (line,) = lines
    squatted = protocol.socket_dir({}, user.uid)  # /tmp/memtop-<uid>, in the namespace's /tmp
    assert f"{squatted} is owned by uid 0, not by you ({user.uid})" in line, line
    assert line.endswith(WHAT_TO_DO), line
