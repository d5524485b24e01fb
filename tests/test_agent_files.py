"""Snapshot files written safely (DESIGN §6): each attack is a real path planted first."""

from __future__ import annotations

import os
import pickle
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from stepping import Stepper

from memtop import protocol
from memtop.agent import files, server
from memtop.agent.probe import ProbeDevice
from memtop.agent.server import Agent
from memtop.sim.allocator import SimulatedCachingAllocator
from memtop.sim.device import LocalDeviceMemory
from memtop.sim.probe import SimulatedGpu, SimulatedProbe
from memtop.sources.agents import AgentClient, AgentError

GiB = 1 << 30


def _leftovers(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if ".memtop-" in n or ".tmp" in n)


def test_new_file_is_private_and_complete(tmp_path: Path):
    target = tmp_path / "snap.pickle"
    assert files.write_private_file(str(target), b"x" * 100_000) == 100_000
    assert target.read_bytes() == b"x" * 100_000
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert _leftovers(tmp_path) == []


def test_symlink_at_the_target_is_refused_and_its_target_untouched(tmp_path: Path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    link = tmp_path / "snap.pickle"
    link.symlink_to(victim)
    for overwrite in (False, True):
        with pytest.raises(files.UnsafeTarget, match="symbolic link"):
            files.write_private_file(str(link), b"pickle", overwrite=overwrite)
    assert victim.read_text() == "precious" and link.is_symlink()
    assert _leftovers(tmp_path) == []


def test_a_planted_old_style_temp_name_is_neither_used_nor_readable(tmp_path: Path):
    # The old agent wrote to "{path}.tmp-{pid}": another user could pre-create it 0666.
    target = tmp_path / "snap.pickle"
    planted = tmp_path / f"snap.pickle.tmp-{os.getpid()}"
    planted.write_bytes(b"")
    planted.chmod(0o666)
    files.write_private_file(str(target), b"secret")
    assert planted.read_bytes() == b""  # nothing went through the planted file
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_device_node_fifo_and_directory_targets_are_refused(tmp_path: Path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    directory = tmp_path / "dir"
    directory.mkdir()
    for target in ("/dev/null", str(fifo), str(directory)):
        with pytest.raises(files.UnsafeTarget, match="not a regular file"):
            files.write_private_file(target, b"pickle", overwrite=True)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert stat.S_ISFIFO(fifo.stat().st_mode) and directory.is_dir()
    assert _leftovers(tmp_path) == [] and os.listdir(directory) == []


def test_existing_file_is_kept_unless_overwrite(tmp_path: Path):
    target = tmp_path / "snap.pickle"
    target.write_bytes(b"old")
    with pytest.raises(files.UnsafeTarget, match="--force"):
        files.write_private_file(str(target), b"new")
    assert target.read_bytes() == b"old"
    files.write_private_file(str(target), b"new", overwrite=True)
    assert target.read_bytes() == b"new" and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert _leftovers(tmp_path) == []


def test_a_file_appearing_while_writing_is_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    target = tmp_path / "snap.pickle"
    real_check = files.check_target

    def check_then_race(path: str, overwrite: bool) -> None:
        real_check(path, overwrite)
        target.write_bytes(b"someone else's")  # appears after the check, before publishing

    monkeypatch.setattr(files, "check_target", check_then_race)
    with pytest.raises(files.UnsafeTarget, match="appeared"):
        files.write_private_file(str(target), b"ours")
    assert target.read_bytes() == b"someone else's"
    assert _leftovers(tmp_path) == []


def test_relative_and_missing_directory_paths_are_refused(tmp_path: Path):
    with pytest.raises(files.UnsafeTarget, match="absolute"):
        files.write_private_file("snap.pickle", b"x")
    with pytest.raises(files.UnsafeTarget, match="cannot open directory"):
        files.write_private_file(str(tmp_path / "no" / "snap.pickle"), b"x")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second local user")
def test_a_directory_the_trainers_user_cannot_write_is_refused(tmp_path: Path):
    # The trainer runs as another user (nobody); root asks it to write into a root-only dir
    # that nobody can reach (pytest's own tmp root is 0700, so make one under /tmp).
    tmp_path = Path(tempfile.mkdtemp(prefix="mt-files-"))
    tmp_path.chmod(0o755)
    target = tmp_path / "snap.pickle"
    script = (
        # Import first, as root: nobody may not be able to read this checkout.
        "import os, sys\n"
        "from memtop.agent import files\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "try:\n    files.write_private_file(sys.argv[1], b'x')\n"
        "except files.UnsafeTarget as exc:\n    print(exc)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run(
        [sys.executable, "-c", script, str(target)],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    try:
        assert "not writable by uid 65534" in done.stdout, done.stderr
        assert not target.exists() and _leftovers(tmp_path) == []
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


# ------------------------------------------------------------------ through the agent


@pytest.fixture
def agent(socket_dir: Path) -> Iterator[Agent]:
    allocator = SimulatedCachingAllocator(LocalDeviceMemory(8 * GiB), 0)
    allocator.malloc(50 << 20)
    probe = SimulatedProbe([SimulatedGpu(ProbeDevice(0, "GPU-f", "Sim", 8 * GiB), allocator)])
    running = Agent(probe, socket_dir)
    running.start()
    yield running
    running.stop()


def test_agent_refuses_an_unsafe_target_before_the_trainer_pays(agent: Agent, tmp_path: Path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "link.pickle").symlink_to(victim)
    with Stepper(agent), AgentClient(agent.pid, agent.directory, timeout=10) as client:
        client.connect()
        with pytest.raises(AgentError) as info:
            client.request("snapshot", {"path": str(tmp_path / "link.pickle")})
        assert info.value.code == protocol.E_BAD_REQUEST and "symbolic link" in info.value.message
        target = tmp_path / "snap.pickle"
        target.write_bytes(b"old")
        with pytest.raises(AgentError, match="--force"):
            client.request("snapshot", {"path": str(target)})
        result = client.request("snapshot", {"path": str(target), "overwrite": True}, timeout=10)
    assert victim.read_text() == "precious"
    assert result["bytes"] == target.stat().st_size
    assert pickle.loads(target.read_bytes())["segments"]
    assert agent.boundary.jobs_run == 1  # the refused requests never reached the trainer


PIPELINED = 100  # far past the budget's burst: most wait their turn in the one connection


def test_pipelined_snapshot_requests_leave_the_thread_count_flat(agent: Agent, tmp_path: Path):
    import socket
    import threading

    with Stepper(agent):
        before = threading.active_count()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(agent.path))
        frames = b"".join(
            protocol.encode_frame(
                {"id": i, "cmd": "snapshot", "args": {"path": str(tmp_path / f"s{i}.pickle")}}
            )
            for i in range(PIPELINED)
        )
        started = time.monotonic()
        sock.sendall(frames)
        sock.settimeout(10)
        replies = []
        while len(replies) < PIPELINED:
            replies.append(protocol.recv_message(sock))
        peak = threading.active_count()
        elapsed = time.monotonic() - started
        sock.close()
    assert peak <= before + 1  # at most the one I/O worker, never a thread per request
    written = [r for r in replies if "result" in r]
    refused = {r["error"]["code"] for r in replies if "error" in r}
    # They take ~3 s under the per-viewer request budget (backpressure, not errors); in that
    # time the snapshot cooldown lets one through every SNAPSHOT_MIN_INTERVAL_S.
    assert 1 <= len(written) <= 1 + elapsed / server.SNAPSHOT_MIN_INTERVAL_S
    assert refused == {protocol.E_RATE_LIMITED}
    assert sorted(r["id"] for r in replies) == list(range(PIPELINED))
