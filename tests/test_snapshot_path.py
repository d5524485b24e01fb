"""`memtop snapshot PID -o FILE` and the `s` key write the path as given (issue 27, finding 2;
issue 21.16): a symbolic link is never followed, with or without --force; a directory is said
to be one at once; an empty snapshot is said to be empty, and why."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from local_users import LocalUser, as_user, local_user, needs_root

from memtop import protocol
from memtop.sim.demo import Demo
from memtop.sources.agents import AgentClient

ROOT = Path(__file__).resolve().parent.parent
VICTIM_TEXT = "ssh-ed25519 AAAA… carol@box\n"


def memtop(*args: str, socket_dir: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "memtop", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir), PYTHONPATH=str(ROOT)),
    )


def wait_for_steps(pid: int, socket_dir: Path, timeout: float = 60) -> None:
    """Snapshots are taken at step boundaries: wait until the trainer has stepped."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with AgentClient(pid, socket_dir, timeout=5) as client:
                client.connect()
                if (client.request("sample").get("step") or 0) >= 1:
                    return
        except Exception:
            pass
        time.sleep(0.2)
    raise AssertionError(f"pid {pid} made no step within {timeout} s")


@pytest.fixture(scope="module")
def trainer() -> Iterator[tuple[int, Path]]:
    """A simulated trainer (GPU segments) of this user, and its socket directory."""
    directory = Path(tempfile.mkdtemp(prefix="mtsn-"))
    directory.chmod(0o700)
    # The tests here write snapshot after snapshot: no cooldown to wait out between them.
    demo = Demo(
        gpus=1,
        scenario="healthy",
        step_time=0.05,
        socket_dir=directory,
        extra_env={"MEMTOP_AGENT_TEST_LIMITS": "snapshot_min_interval_s=0,on_demand_max_share=1"},
    )
    demo.start()
    try:
        assert demo.wait_ready(), f"trainer failed: {demo.failed()}"
        pid = demo.processes[0].pid
        wait_for_steps(pid, directory)
        yield pid, directory
    finally:
        demo.stop()
        shutil.rmtree(directory, ignore_errors=True)


def refused(result: subprocess.CompletedProcess[str], says: str) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.startswith("memtop: ") and result.stderr.count("\n") == 1, result.stderr
    assert says in result.stderr, result.stderr


# (Before the tests of the shared trainer: a module's fixture lives until the module ends, and
# the trainer would step through this test's own.)
@pytest.mark.slow
def test_an_empty_snapshot_is_said_to_be_empty(tmp_path: Path, socket_dir: Path) -> None:
    pytest.importorskip("torch")  # examples/train_cpu.py is a torch trainer
    # A CPU-only trainer under memtop run: its snapshot has no segment.
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir))
    env.pop("MEMTOP_AGENT", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "memtop", "run", "examples/train_cpu.py", "--step-time", "0.02",
         "--device", "cpu"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        # Its agent counted a step: torch imported, the optimizer stepping.  (Its "step 100"
        # line said so 99 steps later: 2 s and more of a torch trainer's CPU for nothing.)
        wait_for_steps(proc.pid, socket_dir)
        out = tmp_path / "cpu.pickle"
        result = memtop("snapshot", str(proc.pid), "-o", str(out), socket_dir=socket_dir)
        assert result.returncode == 0, result.stderr
        assert "an empty snapshot, 0 segments" in result.stdout
        assert "no CUDA memory" in result.stdout and "memory_viz" not in result.stdout
        assert out.is_file()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("force", [False, True])
def test_a_symlink_is_never_written_through(trainer, tmp_path: Path, force: bool) -> None:
    pid, socket_dir = trainer
    victim = tmp_path / "authorized_keys"
    victim.write_text(VICTIM_TEXT)
    link = tmp_path / "snap.pickle"
    link.symlink_to(victim)
    force_flag = ["--force"] if force else []
    result = memtop("snapshot", str(pid), "-o", str(link), *force_flag, socket_dir=socket_dir)
    refused(result, f"{link} is a symbolic link")
    assert victim.read_text() == VICTIM_TEXT and link.is_symlink()


@pytest.mark.parametrize("force", [False, True])
def test_a_dangling_symlink_creates_nothing(trainer, tmp_path: Path, force: bool) -> None:
    pid, socket_dir = trainer
    named = tmp_path / "created-by-the-trainer"
    link = tmp_path / "snap.pickle"
    link.symlink_to(named)
    force_flag = ["--force"] if force else []
    result = memtop("snapshot", str(pid), "-o", str(link), *force_flag, socket_dir=socket_dir)
    refused(result, f"{link} is a symbolic link")
    assert not named.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["snap.pickle"]


@pytest.mark.parametrize("force", [False, True])
def test_a_directory_is_said_to_be_one_at_once(trainer, tmp_path: Path, force: bool) -> None:
    pid, socket_dir = trainer
    force_flag = ["--force"] if force else []
    result = memtop("snapshot", str(pid), "-o", str(tmp_path), *force_flag, socket_dir=socket_dir)
    refused(result, f"{tmp_path} is a directory: give a file name in it")
    assert "--force" not in result.stderr and list(tmp_path.iterdir()) == []


def test_a_relative_path_is_joined_to_the_current_directory_not_resolved(
    trainer, tmp_path: Path
) -> None:
    pid, socket_dir = trainer
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "here").symlink_to(real)  # our own link: a directory we may write through
    result = memtop(
        "snapshot", str(pid), "-o", "here/snap.pickle", socket_dir=socket_dir, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    # Said as given (the cwd joined), and the file is where that path leads.
    assert f"wrote {tmp_path}/here/snap.pickle  (open it at https://pytorch.org/memory_viz)" in (
        result.stdout
    )
    assert (real / "snap.pickle").is_file()


def test_the_s_key_never_follows_a_link_at_its_file_name(trainer, tmp_path: Path) -> None:
    from ui_helpers import live_app, notifications, wait_for

    from memtop.ui.widgets.process_table import ProcessTable

    pid, socket_dir = trainer
    # The `s` key's file names are predictable (pid and second): links planted for the next
    # minute's names, all dangling, each to a file the trainer must not create.
    named = tmp_path / "elsewhere"
    named.mkdir()
    now = int(time.time())
    for second in range(now - 2, now + 60):
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(second))
        (tmp_path / f"memtop-snapshot-{pid}-{stamp}.pickle").symlink_to(named / stamp)
    app, sampler = live_app(socket_dir, snapshot_dir=tmp_path)

    async def main() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            table = app.query_one(ProcessTable)
            await wait_for(
                pilot, lambda: any(r.pid == pid for r in table.rows_by_key.values()), timeout=30
            )
            key = next(k for k, r in table.rows_by_key.items() if r.pid == pid)
            table.move_cursor(row=table.get_row_index(key))

            # The module's trainer may have written a snapshot moments ago (another test): its
            # cooldown refuses first, and the key is pressed again once it has passed.
            def new_since(before: set[int]) -> list[str]:
                return [
                    f"{n.title}: {n.message}" for n in app._notifications if id(n) not in before
                ]

            for _ in range(10):
                before = {id(n) for n in app._notifications}
                await pilot.press("s")
                await wait_for(
                    pilot,
                    lambda before=before: any("snapshot in pid" in n for n in new_since(before)),
                    30,
                )
                if not any("rate_limited" in n for n in new_since(before)):
                    break
                await pilot.pause(1.5)
            assert any("symbolic link" in n for n in notifications(app)), notifications(app)

    try:
        asyncio.run(main())
    finally:
        sampler.stop()
    assert list(named.iterdir()) == []


# ------------------------------------------------------------------ links of another user


@pytest.fixture
def sticky() -> Iterator[tuple[Path, LocalUser]]:
    """A sticky, world-writable directory like /tmp (random name), and a local user."""
    directory = Path(tempfile.mkdtemp(prefix="mtst-"))
    directory.chmod(0o1777)
    with local_user("mtsnp") as user:
        try:
            yield directory, user
        finally:
            shutil.rmtree(directory, ignore_errors=True)


@needs_root
def test_another_users_links_lead_roots_trainer_nowhere(trainer, sticky, tmp_path: Path) -> None:
    pid, socket_dir = trainer
    directory, user = sticky
    carol = tmp_path / "carol-ssh"
    carol.mkdir()
    victim = carol / "authorized_keys"
    victim.write_text(VICTIM_TEXT)
    for link, to in (("snap.pickle", victim), ("out", carol)):
        made = as_user(user, "ln", "-s", str(to), str(directory / link))
        assert made.wait(10) == 0
    result = memtop(
        "snapshot", str(pid), "-o", str(directory / "snap.pickle"), "--force",
        socket_dir=socket_dir,
    )  # fmt: skip
    refused(result, "is a symbolic link")
    # A link above the file, in a directory anyone may write: not gone through either.
    result = memtop(
        "snapshot", str(pid), "-o", str(directory / "out" / "authorized_keys"), "--force",
        socket_dir=socket_dir,
    )  # fmt: skip
    refused(result, f"{directory / 'out'} is a symbolic link owned by uid {user.uid}")
    assert victim.read_text() == VICTIM_TEXT and sorted(os.listdir(carol)) == ["authorized_keys"]
    assert protocol.pid_alive(pid)
