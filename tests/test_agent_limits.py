"""The agent's limits (docs/agent.md): each is reached for real, and the trainer goes on."""

from __future__ import annotations

import contextlib
import json
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
from memtop.agent import server as agent_server
from memtop.agent.probe import ProbeDevice
from memtop.agent.server import Agent
from memtop.sim.allocator import SimulatedCachingAllocator
from memtop.sim.device import LocalDeviceMemory
from memtop.sim.probe import SimulatedGpu, SimulatedProbe
from memtop.sources.agents import AgentClient

GiB = 1 << 30


def _probe() -> SimulatedProbe:
    allocator = SimulatedCachingAllocator(LocalDeviceMemory(8 * GiB), 0)
    allocator.malloc(10 << 20)
    return SimulatedProbe([SimulatedGpu(ProbeDevice(0, "GPU-l", "Sim", 8 * GiB), allocator)])


@pytest.fixture
def agent(socket_dir: Path) -> Iterator[Agent]:
    running = Agent(_probe(), socket_dir)
    running.start()
    yield running
    running.stop()


def _connect(agent: Agent) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(agent.path))
    return sock


def _serves(agent: Agent) -> bool:
    with AgentClient(agent.pid, agent.directory, timeout=5) as client:
        client.connect()
        return bool(client.sample().devices)


def test_the_33rd_viewer_is_told_why_and_the_others_are_served(agent: Agent):
    held = [_connect(agent) for _ in range(agent_server.MAX_CONNECTIONS)]
    try:
        for sock in held:  # each is accepted and answers
            sock.sendall(protocol.encode_frame({"id": 1, "cmd": "hello"}))
            assert protocol.recv_message(sock)["result"]["pid"] == agent.pid
        extra = _connect(agent)
        reply = protocol.recv_message(extra)
        assert reply["error"]["code"] == protocol.E_UNAVAILABLE
        assert f"at most {agent_server.MAX_CONNECTIONS} viewers" in reply["error"]["message"]
        extra.close()
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            assert _serves(agent)
            break
        except Exception:
            time.sleep(0.1)  # the agent notices the closed sockets on its next turn
    else:
        pytest.fail("the agent did not serve again after the viewers left")


def test_an_idle_viewer_is_hung_up_on(monkeypatch, agent: Agent):
    monkeypatch.setattr(agent_server, "IDLE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(agent_server, "SWEEP_INTERVAL_S", 0.1)
    idle = _connect(agent)
    idle.sendall(protocol.encode_frame({"id": 1, "cmd": "hello"}))
    protocol.recv_message(idle)
    with pytest.raises(protocol.ConnectionClosed):
        protocol.recv_message(idle)  # no request for 0.5 s: the agent closes
    assert _serves(agent)


def test_a_frame_begun_and_never_finished_gets_an_error_and_a_hangup(monkeypatch, agent: Agent):
    monkeypatch.setattr(agent_server, "PARTIAL_FRAME_TIMEOUT_S", 0.5)
    monkeypatch.setattr(agent_server, "SWEEP_INTERVAL_S", 0.1)
    slow = _connect(agent)
    slow.sendall(struct.pack(">I", 100) + b'{"id": 1, "cm')  # and then nothing
    reply = protocol.recv_message(slow)
    assert (
        reply["error"]["code"] == protocol.E_BAD_FRAME
        and "not completed" in (reply["error"]["message"])
    )
    with pytest.raises(protocol.ConnectionClosed):
        protocol.recv_message(slow)
    assert _serves(agent)


def test_a_request_over_64_kib_is_refused_before_it_is_read(agent: Agent):
    big = _connect(agent)
    big.sendall(struct.pack(">I", agent_server.MAX_REQUEST_BYTES + 1))
    reply = protocol.recv_message(big)
    assert reply["error"]["code"] == protocol.E_FRAME_TOO_LARGE
    assert _serves(agent)


def test_a_thousand_deep_request_gets_an_error_frame(agent: Agent):
    deep = _connect(agent)
    body = ('{"id": 1, "cmd": "sample", "args": ' + "[" * 1000 + "]" * 1000 + "}").encode()
    deep.sendall(struct.pack(">I", len(body)) + body)
    reply = protocol.recv_message(deep)
    assert "error" in reply and reply["error"]["code"] in (
        protocol.E_BAD_FRAME,
        protocol.E_BAD_REQUEST,
    )
    assert _serves(agent)


def test_a_hammering_viewer_is_slowed_not_refused_and_others_keep_their_pace(agent: Agent):
    hammer = _connect(agent)
    n = 200
    frames = b"".join(protocol.encode_frame({"id": i, "cmd": "hello"}) for i in range(n))
    started = time.monotonic()
    hammer.sendall(frames)
    # Meanwhile another viewer's samples come back at once.
    rtts = []
    with AgentClient(agent.pid, agent.directory, timeout=5) as client:
        client.connect()
        for _ in range(10):
            t0 = time.perf_counter()
            client.sample()
            rtts.append(time.perf_counter() - t0)
    replies = [protocol.recv_message(hammer) for _ in range(n)]
    elapsed = time.monotonic() - started
    assert all("result" in r for r in replies)  # backpressure, not errors
    assert [r["id"] for r in replies] == list(range(n))
    budget = (n - agent_server.REQUEST_BURST) / agent_server.REQUESTS_PER_S
    assert elapsed >= 0.8 * budget
    assert sorted(rtts)[5] < 0.2


def test_out_of_file_descriptors_the_agent_does_not_spin(tmp_path: Path):
    # A trainer whose descriptors are used up (ulimit -n 64): the agent must back off, not
    # busy-loop on a listener that stays readable.  Its thread's CPU is read from /proc.
    script = f"""
import os, resource, socket, sys, time, json
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_agent_limits import _probe
from memtop.agent.server import Agent
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
from pathlib import Path
agent = Agent(_probe(), Path({str(tmp_path)!r}))
agent.start()
# Opened before the descriptors run out: re-read with pread.
stat_fd = os.open(f"/proc/self/task/{{agent._thread.native_id}}/schedstat", os.O_RDONLY)
hog = []
try:
    while True:
        hog.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
print("ready", flush=True)
sys.stdin.readline()
def cpu():
    return int(os.pread(stat_fd, 200, 0).split()[0]) / 1e9
c0 = cpu(); time.sleep(2.0); used = cpu() - c0
for fd in hog[:8]:
    os.close(fd)
print(json.dumps({{"cpu_s": used, "errors": list(agent.errors)[:3]}}), flush=True)
sys.stdin.readline()
"""
    trainer = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(Path(__file__).parents[1]),
    )
    assert trainer.stdin is not None and trainer.stdout is not None
    try:
        assert trainer.stdout.readline().strip() == "ready"
        waiting = []
        for _ in range(5):  # viewers knock; the agent cannot accept them
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(str(tmp_path / f"{trainer.pid}.sock"))
            waiting.append(sock)
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        report = json.loads(trainer.stdout.readline())
        assert report["cpu_s"] < 0.2, report  # a busy loop would burn ~2 s of CPU here
        assert any("accept" in e for e in report["errors"]), report
        # With descriptors free again, the agent accepts and answers.
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect(str(tmp_path / f"{trainer.pid}.sock"))
        sock.sendall(protocol.encode_frame({"id": 1, "cmd": "hello"}))
        deadline = time.monotonic() + 5
        reply = None
        while reply is None and time.monotonic() < deadline:
            reply = protocol.recv_message(sock)
            if "result" not in reply:
                reply = None  # a refusal meant for an earlier knock
        assert reply is not None and reply["result"]["pid"] == trainer.pid
        for sock in waiting:
            sock.close()
    finally:
        trainer.stdin.write("done\n")
        trainer.stdin.flush()
        trainer.wait(10)


def test_the_trainer_steps_on_through_all_of_it(agent: Agent):
    with Stepper(agent) as stepper:
        before = agent.boundary.step or 0
        garbage = _connect(agent)
        garbage.sendall(struct.pack(">I", 9) + b"not json!")
        protocol.recv_message(garbage)
        time.sleep(0.3)
        assert (agent.boundary.step or 0) > before
        assert stepper is not None
