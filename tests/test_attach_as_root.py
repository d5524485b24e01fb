"""`memtop attach` as root on another user's process (issue 27, finding 1): nothing the target's
user chose runs as root, and root is asked first.

The attacker, a real local user made for the test, plants a `json.py` in the working directory
and a `sitecustomize.py` on the PYTHONPATH of its own `python3 -c …`; each writes a line with
its euid and pid to a marker file when imported.  Root then attaches.  The old probe ran the
target's interpreter as root, in the target's directory, with its environment: both files ran
with euid 0.  Now the planted files run only where the user ran them anyway: in its own process.
"""

from __future__ import annotations

import os
import pty
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from local_users import LocalUser, as_user, local_user, needs_root, wait_ready

from memtop.engine import attach

pytestmark = [
    pytest.mark.slow,
    needs_root,
    pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed"),
]

ROOT = Path(__file__).resolve().parent.parent
# The attacker's interpreter: the system's, which it may run (this venv's lives under /root).
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")
PLANT = """\
import os
with open({marker!r}, "a") as handle:
    handle.write(f"{name} euid={{os.geteuid()}} pid={{os.getpid()}}\\n")
"""
# json.py hands over to the real json once it has written its line, so that the target (the
# attacker's own process, where the agent imports json) goes on working.
JSON_HANDOVER = """\
import sys
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
del sys.modules["json"]
import json
"""


@dataclass
class Planted:
    user: LocalUser
    target: subprocess.Popen[bytes]
    marker: Path
    socket_dir: Path

    def lines(self) -> list[str]:
        try:
            return self.marker.read_text().splitlines()
        except FileNotFoundError:
            return []


@pytest.fixture
def planted() -> Iterator[Planted]:
    if SYSTEM_PYTHON is None:
        pytest.skip("no system python3 for the other user")
    version = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import sys; print(*sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if tuple(map(int, version)) != sys.version_info[:2]:
        pytest.skip("the system python3 is not this Python's version: memtop is not importable")
    # Under /tmp for a short socket path, with a random name: the other user must reach it
    # (tmp_path lies under root's 0700 directory).
    work = Path(tempfile.mkdtemp(prefix="mtar-", dir="/tmp"))
    work.chmod(0o755)
    with local_user("mtatt") as user:
        for name in ("cwd", "path", "sock", "marks"):
            (work / name).mkdir(mode=0o700)
            os.chown(work / name, user.uid, user.gid)
        marker = work / "marks" / "ran"
        (work / "cwd" / "json.py").write_text(
            PLANT.format(marker=str(marker), name="json.py") + JSON_HANDOVER
        )
        (work / "path" / "sitecustomize.py").write_text(
            PLANT.format(marker=str(marker), name="sitecustomize.py")
        )
        for planted_file in (work / "cwd" / "json.py", work / "path" / "sitecustomize.py"):
            os.chown(planted_file, user.uid, user.gid)
        env = {
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(work / "path"),
            "MEMTOP_SOCKET_DIR": str(work / "sock"),
        }
        target = as_user(
            user, SYSTEM_PYTHON, "-c",
            # Markup in an argv ("[/bold]" raised MarkupError in root's attach dialog).
            "import time; print('ready', flush=True)  # [/bold] [@click=app.quit]\n"
            "while True: time.sleep(0.05)",
            cwd=str(work / "cwd"), env=env,
        )  # fmt: skip
        try:
            wait_ready(target)
            yield Planted(user, target, marker, work / "sock")
        finally:
            target.kill()
            target.wait()
            shutil.rmtree(work, ignore_errors=True)


def memtop(*args: str, stdin: int | None = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "memtop", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        stdin=stdin,
        env={k: v for k, v in os.environ.items() if k != "MEMTOP_SOCKET_DIR"},
    )


def test_root_attaching_runs_nothing_of_the_users_as_root(planted: Planted) -> None:
    pid = planted.target.pid
    # The target's own start ran its sitecustomize, as the user: the trap is armed.
    assert planted.lines() == [f"sitecustomize.py euid={planted.user.uid} pid={pid}"]
    result = memtop("attach", str(pid), "--yes")
    assert result.returncode == 0, result.stderr
    assert f"attached to pid {pid}" in result.stdout
    assert (planted.socket_dir / f"{pid}.sock").exists()
    # Nothing ran as root; and nothing ran anywhere but in the user's own process (the agent,
    # started in it, imported json from the target's path as that process always would).
    lines = planted.lines()
    assert not [line for line in lines if "euid=0 " in line], lines
    assert all(line.endswith(f"pid={pid}") for line in lines), lines


def test_the_probe_runs_as_the_user_isolated(planted: Planted) -> None:
    target = attach.inspect(planted.target.pid)
    assert target.uid == planted.user.uid and target.gid == planted.user.gid
    assert target.exe == SYSTEM_PYTHON and target.version == sys.version_info[:2]
    assert not target.problems
    assert planted.lines() == [f"sitecustomize.py euid={planted.user.uid} pid={target.pid}"]


def test_root_is_asked_and_a_script_without_yes_is_refused(planted: Planted) -> None:
    pid = planted.target.pid
    refused = memtop("attach", str(pid))
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"belongs to {planted.user.name} (uid {planted.user.uid})" in refused.stderr
    assert "--yes" in refused.stderr
    assert not (planted.socket_dir / f"{pid}.sock").exists()
    # The library refuses too, unless told the uid that was asked about.
    with pytest.raises(attach.AttachRefused, match="add --yes"):
        attach.attach(pid)
    with pytest.raises(attach.AttachRefused, match="add --yes"):
        attach.attach(pid, consent_uid=planted.user.uid + 1)
    assert len(planted.lines()) == 1  # only the target's own start


def ask_on_a_terminal(pid: int, answer: bytes) -> tuple[int, str]:
    """Run `memtop attach PID` on a pty, answer its question; (exit status, all it said)."""
    master, slave = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "memtop", "attach", str(pid)],
        stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, start_new_session=True,
        env={k: v for k, v in os.environ.items() if k != "MEMTOP_SOCKET_DIR"},
    )  # fmt: skip
    os.close(slave)
    said = b""
    answered = False
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # EIO: the other side is closed
                    break
                if not chunk:
                    break
                said += chunk
            if not answered and b"[y/N]" in said:
                os.write(master, answer)
                answered = True
            if process.poll() is not None and not ready:
                break
        return process.wait(timeout=60), said.decode(errors="replace")
    finally:
        os.close(master)
        if process.poll() is None:
            process.kill()
            process.wait()


def test_root_is_asked_on_a_terminal(planted: Planted) -> None:
    pid = planted.target.pid
    code, said = ask_on_a_terminal(pid, b"\n")  # the default is no
    assert code == 1 and f"not attached to pid {pid}" in said
    assert f"belongs to {planted.user.name} (uid {planted.user.uid}), not to root" in said
    assert not (planted.socket_dir / f"{pid}.sock").exists()
    code, said = ask_on_a_terminal(pid, b"y\n")
    assert code == 0 and f"attached to pid {pid}" in said, said
    assert not [line for line in planted.lines() if "euid=0 " in line]


def test_dashboard_a_names_the_owner_and_attaches_after_yes(planted: Planted) -> None:
    import asyncio

    from test_attach import OneGpuListing
    from ui_helpers import notifications, wait_for

    from memtop.engine.sampler import Sampler
    from memtop.engine.store import Store
    from memtop.sources.agents import AgentPool
    from memtop.ui.app import MemtopApp
    from memtop.ui.screens.confirm import ConfirmScreen
    from memtop.ui.widgets.process_table import ProcessTable

    pid = planted.target.pid
    store = Store()
    sampler = Sampler(store, OneGpuListing(pid), AgentPool(planted.socket_dir), interval=0.25)
    app = MemtopApp(store, sampler, interval=0.25)

    def states() -> set[str]:
        return {r.state for r in app.query_one(ProcessTable).rows_by_key.values() if r.pid == pid}

    async def main() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(pilot, lambda: states() == {"no agent"})
            await pilot.press("a")
            screen = app.screen
            assert isinstance(screen, ConfirmScreen)
            assert planted.user.name in screen.question
            assert f"belongs to {planted.user.name} (uid {planted.user.uid})" in screen.detail
            assert "[/bold] [@click=app.quit]" in str(screen.query_one(".muted").render())
            await pilot.press("y")
            await wait_for(
                pilot,
                lambda: any(f"attached to pid {pid}" in n for n in notifications(app)),
                timeout=60,
            )

    try:
        asyncio.run(main())
    finally:
        sampler.stop()
    assert not [line for line in planted.lines() if "euid=0 " in line], planted.lines()
