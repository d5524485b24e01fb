"""The agent over a real socket: commands, step marks, several viewers, bad peers."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from stepping import Stepper

from memtop import protocol
from memtop.agent.probe import ProbeDevice
from memtop.agent.server import Agent
from memtop.sim.allocator import SimulatedCachingAllocator
from memtop.sim.device import LocalDeviceMemory
from memtop.sim.probe import SimulatedGpu, SimulatedProbe
from memtop.sources.agents import AgentClient, AgentError, AgentUnreachable

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def allocator() -> SimulatedCachingAllocator:
    return SimulatedCachingAllocator(LocalDeviceMemory(8 * GiB), 0)


@pytest.fixture
def agent(socket_dir: Path, allocator: SimulatedCachingAllocator) -> Iterator[Agent]:
    device = ProbeDevice(0, "GPU-00000000-0000-0000-0000-000000000001", "Sim GPU", 8 * GiB)
    probe = SimulatedProbe([SimulatedGpu(device, allocator)], allocator_conf="max_split_size_mb:64")
    server = Agent(probe, socket_dir, argv=["train.py", "--epochs", "3"])
    server.start()
    yield server
    server.stop()


def client_for(agent: Agent) -> AgentClient:
    client = AgentClient(agent.pid, agent.directory, timeout=5.0)
    client.connect()
    return client


def test_socket_is_private_and_named_after_the_pid(agent: Agent):
    assert agent.path is not None and agent.path.name == f"{os.getpid()}.sock"
    assert os.stat(agent.path).st_mode & 0o077 == 0


def test_hello_follows_the_wire_schema(agent: Agent):
    with client_for(agent) as client:
        hello = client.hello
    assert hello is not None
    assert hello.protocol == 1 and hello.pid == os.getpid()
    assert hello.argv == ("train.py", "--epochs", "3")
    assert hello.allocator_conf == "max_split_size_mb:64"
    assert [d.uuid for d in hello.devices] == ["GPU-00000000-0000-0000-0000-000000000001"]


def test_sample_reports_the_allocator(agent: Agent, allocator: SimulatedCachingAllocator):
    block = allocator.malloc(5 * MiB)
    with client_for(agent) as client:
        sample = client.sample()
    device = sample.devices[0]
    assert device.allocated == 5 * MiB
    assert device.reserved == 20 * MiB
    assert device.total_bytes == 8 * GiB and 0 < device.free_bytes < 8 * GiB
    allocator.free(block)


def test_step_marks_reach_every_viewer_once(agent: Agent, allocator: SimulatedCachingAllocator):
    agent.boundary.mark_interval_s = 0.0  # a mark at every step, to check delivery
    first = client_for(agent)
    for i in range(1500):
        allocator.malloc(4096) if i % 100 == 0 else None
        agent.on_step(explicit=True)
    second = client_for(agent)
    a = first.sample()
    b = second.sample()
    # The first sample of each connection returns everything still buffered (≥ 1024 marks).
    assert [m.step for m in a.step_marks] == list(range(1, 1501))
    assert [m.step for m in b.step_marks] == list(range(1, 1501))
    assert a.step == 1500 and a.step_marks[-1].allocated[0] == allocator.memory_allocated()
    agent.on_step(explicit=True)
    assert [m.step for m in first.sample().step_marks] == [1501]
    assert first.sample().step_marks == ()
    assert [m.step for m in second.sample().step_marks] == [1501]
    first.close()
    second.close()


def test_max_marks_keeps_the_newest_and_moves_the_cursor_past_the_rest(agent: Agent):
    agent.boundary.mark_interval_s = 0.0
    for _ in range(1500):
        agent.on_step(explicit=True)
    with client_for(agent) as viewer, client_for(agent) as everything:
        # The dashboard asks for the window it reads; the marks older than that are skipped,
        # not delivered on the next sample.
        assert [m.step for m in viewer.sample(max_marks=1024).step_marks] == list(range(477, 1501))
        agent.on_step(explicit=True)
        agent.on_step(explicit=True)
        assert [m.step for m in viewer.sample(max_marks=1).step_marks] == [1502]
        assert [m.step for m in viewer.sample(max_marks=5).step_marks] == []
        # Without the argument: every mark still buffered, as DESIGN §6 promises.
        assert len(everything.sample().step_marks) == 1502
        for bad in (0, -3, True, 2.5, "10"):
            with pytest.raises(AgentError) as refused:
                viewer.sample(max_marks=bad)  # type: ignore[arg-type]
            assert refused.value.code == "bad_request"
        assert viewer.sample().devices  # the connection is still good


def test_marks_as_columns_are_the_marks_as_rows(agent: Agent, allocator: SimulatedCachingAllocator):
    agent.boundary.mark_interval_s = 0.0
    for i in range(300):
        allocator.malloc(4096) if i % 50 == 0 else None
        agent.on_step(explicit=True)
    with client_for(agent) as rows, client_for(agent) as columns:
        as_rows = rows.sample(max_marks=200)
        raw = columns.request("sample", {"max_marks": 200, "mark_layout": "columns"})
        assert raw["step_marks"] == [] and len(raw["step_mark_columns"]["step"]) == 200
        assert protocol.parse_sample(raw).step_marks == as_rows.step_marks
        agent.on_step(explicit=True)
        assert [m.step for m in columns.sample(columns=True).step_marks] == [301]
        assert columns.sample(columns=True).step_marks == ()  # nothing new: still readable
        with pytest.raises(AgentError) as refused:
            columns.request("sample", {"mark_layout": "csv"})
        assert refused.value.code == "bad_request"


def test_optimizer_hook_steps_are_ignored_once_memtop_step_is_used(agent: Agent):
    agent.on_step()
    agent.on_step()
    assert agent.step == 2
    agent.on_step(explicit=True)
    agent.on_step()  # the hook would double count now
    assert agent.step == 3


def test_viewer_can_reconnect(agent: Agent):
    client = client_for(agent)
    client.sample()
    client.close()
    with client_for(agent) as again:
        assert again.sample().devices


def test_cleanup_releases_cached_segments(agent: Agent, allocator: SimulatedCachingAllocator):
    blocks = [allocator.malloc(30 * MiB) for _ in range(4)]
    for block in blocks:
        allocator.free(block)
    assert allocator.memory_reserved() == 4 * 30 * MiB
    with client_for(agent) as client, Stepper(agent):
        result = client.request("cleanup", timeout=10)
        assert result["released_bytes"] == {"0": 120 * MiB}
        assert result["reserved_after"] == {"0": 0}
        assert result["at_step_boundary"] is True
        with pytest.raises(AgentError) as info:
            client.request("cleanup")
        assert info.value.code == protocol.E_RATE_LIMITED
    assert allocator.memory_reserved() == 0


def test_a_cleanup_that_did_nothing_starts_no_cooldown(socket_dir: Path):
    # A CPU-only trainer: no CUDA device in use, so a cleanup has nothing to release. It used to
    # run gc.collect() all the same and charge its cost, and the next said "can run again in
    # 262 s" for an action that had done nothing (issue 21, item 17).
    server = Agent(SimulatedProbe([]), socket_dir)
    server.start()
    try:
        with client_for(server) as client, Stepper(server):
            first = client.request("cleanup", timeout=10)
            assert first["released_bytes"] == {} and first["nothing_to_do"]
            assert first["gc_collected"] == 0  # no collection ran in the trainer
            again = client.request("cleanup", timeout=10)  # not refused: no cooldown
            assert again["released_bytes"] == {}
    finally:
        server.stop()


def test_cleanup_without_steps_is_refused_with_the_reason(agent: Agent):
    with client_for(agent) as client, pytest.raises(AgentError) as info:
        client.request("cleanup")
    assert info.value.code == protocol.E_UNAVAILABLE
    assert "no training step has been seen" in info.value.message


def test_cleanup_waits_for_the_next_step_when_the_trainer_steps(
    agent: Agent, allocator: SimulatedCachingAllocator
):
    agent.on_step(explicit=True)
    allocator.free(allocator.malloc(40 * MiB))
    import threading

    stepper = threading.Timer(0.3, agent.on_step, kwargs={"explicit": True})
    stepper.start()
    started = time.monotonic()
    with client_for(agent) as client:
        result = client.request("cleanup", timeout=10)
    stepper.join()
    assert result["at_step_boundary"] is True
    assert result["after_step"] == 2
    assert time.monotonic() - started >= 0.25
    assert result["released_bytes"]["0"] == 40 * MiB


def test_cleanup_when_no_step_comes_in_time_says_so(agent: Agent):
    agent.on_step(explicit=True)
    with client_for(agent) as client, pytest.raises(AgentError) as info:
        client.request("cleanup", {"wait_s": 0.5}, timeout=5)
    assert info.value.code == protocol.E_UNAVAILABLE
    assert "no step ended in time" in info.value.message
    agent.on_step(explicit=True)  # the expired job must not run late
    assert agent.boundary.jobs_run == 0


def test_reset_peak(agent: Agent, allocator: SimulatedCachingAllocator):
    allocator.free(allocator.malloc(50 * MiB))
    assert allocator.memory_stats()["allocated_bytes.all.peak"] == 50 * MiB
    with client_for(agent) as client:
        reply = client.request("reset_peak")
        assert reply["devices"] == [0] and isinstance(reply["action_seq"], int)  # logged
    assert allocator.memory_stats()["allocated_bytes.all.peak"] == 0


def test_snapshot_writes_a_pickle_and_summarises(
    agent: Agent, allocator: SimulatedCachingAllocator
):
    keep = allocator.malloc(12 * MiB)
    hole = allocator.malloc(6 * MiB)
    allocator.malloc(3 * MiB)
    allocator.free(hole)
    path = agent.directory / "snap.pickle"  # type: ignore[operator]
    with client_for(agent) as client, Stepper(agent):
        result = client.request("snapshot", {"path": str(path)}, timeout=10)
        with pytest.raises(AgentError) as info:
            client.request("snapshot", {"path": "relative.pickle"})
        assert info.value.code == protocol.E_BAD_REQUEST
    with open(path, "rb") as fh:
        data = pickle.load(fh)
    assert sum(seg["total_size"] for seg in data["segments"]) == allocator.memory_reserved()
    summary = result["devices"]["0"]
    assert summary["reserved_bytes"] == allocator.memory_reserved()
    assert summary["allocated_bytes"] == allocator.memory_allocated()
    assert 0 < summary["external_fragmentation"] < 1
    assert result["bytes"] == path.stat().st_size and path.stat().st_mode & 0o777 == 0o600
    assert keep


def test_breakdown_without_a_model_is_empty(agent: Agent):
    with client_for(agent) as client, Stepper(agent):
        reply = client.request("breakdown", {"wait_s": 5})
    assert reply["devices"] == {} and reply["measured"] == "after_step" and reply["step"] >= 1


def test_breakdown_without_steps_is_refused_with_the_reason(agent: Agent):
    with client_for(agent) as client, pytest.raises(AgentError) as info:
        client.request("breakdown")
    assert info.value.code == protocol.E_UNAVAILABLE


def test_several_viewers_at_once(agent: Agent):
    clients = [client_for(agent) for _ in range(8)]
    for _ in range(5):
        for client in clients:
            assert client.sample().devices[0].index == 0
    for client in clients:
        client.close()


def test_unknown_command_gets_an_error_frame_and_the_connection_stays(agent: Agent):
    with client_for(agent) as client:
        with pytest.raises(AgentError) as info:
            client.request("shutdown")
        assert info.value.code == protocol.E_UNKNOWN_COMMAND
        assert client.sample().devices


def raw_connect(agent: Agent) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(str(agent.path))
    return sock


def test_garbage_frame_gets_an_error_and_a_hangup_and_others_are_served(agent: Agent):
    with client_for(agent) as bystander:
        sock = raw_connect(agent)
        sock.sendall(struct.pack(">I", 9) + b"not json!")
        reply = protocol.recv_message(sock)
        assert reply["error"]["code"] == protocol.E_BAD_FRAME
        with pytest.raises(protocol.ConnectionClosed):
            protocol.recv_message(sock)
        sock.close()
        oversize = raw_connect(agent)
        oversize.sendall(struct.pack(">I", 50 << 20))
        assert protocol.recv_message(oversize)["error"]["code"] == protocol.E_FRAME_TOO_LARGE
        oversize.close()
        assert bystander.sample().devices


def test_viewer_killed_mid_frame_does_not_hurt_the_agent(agent: Agent):
    script = (
        "import socket, struct, os, signal, sys\n"
        "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
        's.sendall(struct.pack(\'>I\', 5000) + b\'{"id": 1, "cmd": "sam\')\n'
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    victim = subprocess.run([sys.executable, "-c", script, str(agent.path)])
    assert victim.returncode == -signal.SIGKILL
    with client_for(agent) as client:
        assert client.sample().devices
    assert not agent.errors


def test_viewer_that_never_reads_is_dropped_without_stalling_others(agent: Agent):
    hog = raw_connect(agent)
    request = protocol.encode_frame({"id": 1, "cmd": "hello"})
    hog.sendall(request * 200)  # replies pile up unread
    with client_for(agent) as client:
        assert client.sample().devices
    hog.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another uid")
def test_peer_of_another_uid_is_refused(agent: Agent):
    assert agent.directory is not None and agent.path is not None
    # Let uid 65534 reach the socket at all, so that SO_PEERCRED is what refuses it.
    agent.directory.chmod(0o711)
    agent.path.chmod(0o777)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        code = 3
        try:
            os.close(read_end)
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            sock.connect(str(agent.path))
            # The agent may have said no and hung up before our request arrives.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                protocol.send_message(sock, {"id": 1, "cmd": "hello"})
            reply = protocol.recv_message(sock)
            os.write(write_end, repr(reply).encode())
            code = 0
        except Exception as exc:
            os.write(write_end, f"exception {exc!r}".encode())
        finally:
            os._exit(code)
    os.close(write_end)
    _, status = os.waitpid(child, 0)
    answer = os.read(read_end, 4096).decode()
    os.close(read_end)
    assert os.WEXITSTATUS(status) == 0, answer
    assert "forbidden" in answer and "65534" in answer
    assert "result" not in answer
    with client_for(agent) as client:  # the owner is still served
        assert client.sample().devices


def test_stopped_agent_removes_its_socket(socket_dir: Path, allocator: SimulatedCachingAllocator):
    probe = SimulatedProbe([SimulatedGpu(ProbeDevice(0, "GPU-x", "g", 1), allocator)])
    server = Agent(probe, socket_dir)
    path = server.start()
    assert path.exists()
    server.stop()
    assert not path.exists()
    with pytest.raises(AgentUnreachable):
        AgentClient(os.getpid(), socket_dir).connect()


def test_first_sample_with_many_devices_and_full_mark_buffer_fits_a_frame(socket_dir: Path):
    gpus = [
        SimulatedGpu(
            ProbeDevice(i, f"GPU-{i}", "Sim GPU", 8 * GiB),
            SimulatedCachingAllocator(LocalDeviceMemory(8 * GiB), i),
        )
        for i in range(8)
    ]
    server = Agent(SimulatedProbe(gpus), socket_dir)
    server.boundary.mark_interval_s = 0.0
    server.start()
    try:
        for _ in range(5000):
            server.on_step(explicit=True)
        with client_for(server) as client:
            sample = client.sample()
            assert 1024 <= len(sample.step_marks) < 5000
            assert sample.step_marks[-1].step == 5000  # the newest are the ones kept
            assert len(sample.step_marks[-1].allocated) == 8
            server.on_step(explicit=True)
            assert [m.step for m in client.sample().step_marks] == [5001]
    finally:
        server.stop()


def test_the_socket_is_named_for_the_pid_only_once_it_listens(
    socket_dir: Path, allocator: SimulatedCachingAllocator, monkeypatch: pytest.MonkeyPatch
):
    # Bound under its own name, the socket refused every viewer that found it before listen()
    # ("nothing listens on the agent socket of pid N"): a CI run lost a module's shared demo
    # to that window.  What a viewer could find, at the moment the agent starts listening:
    path = protocol.socket_path(os.getpid(), socket_dir)
    seen: list[tuple[bool, list[int]]] = []
    listen = socket.socket.listen

    def listening(self: socket.socket, *args: int) -> None:
        if self.family == socket.AF_UNIX:
            seen.append((path.exists(), protocol.list_agent_sockets(socket_dir)))
        listen(self, *args)

    monkeypatch.setattr(socket.socket, "listen", listening)
    probe = SimulatedProbe([SimulatedGpu(ProbeDevice(0, "GPU-x", "g", 1), allocator)])
    server = Agent(probe, socket_dir)
    try:
        assert server.start() == path
        assert seen == [(False, [])]  # nothing named for the pid, nothing discovered
        assert os.stat(path).st_mode & 0o077 == 0
        assert sorted(os.listdir(socket_dir)) == [path.name]  # the binding name is gone
        with client_for(server) as client:
            assert client.sample().devices
    finally:
        server.stop()
    assert not path.exists()
