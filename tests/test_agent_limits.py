"""The agent's limits (docs/agent.md): each is reached for real, and the trainer goes on."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
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


def test_the_33rd_viewer_is_told_why_and_the_others_are_served(monkeypatch, socket_dir: Path):
    # 32 connections of one uid opened at once, each saying hello, cost the agent thread about
    # 5 ms: at its CPU bound, where the governor rightly refuses a uid that opens connections
    # that fast.  The cap on viewers is what this test checks, so the burst is lifted.
    monkeypatch.setenv("MEMTOP_AGENT_TEST_LIMITS", "connect_exempt_burst=1e9")
    agent = Agent(_probe(), socket_dir)
    agent.start()
    try:
        _the_33rd_viewer_is_told_why(agent)
    finally:
        agent.stop()


def _the_33rd_viewer_is_told_why(agent: Agent) -> None:
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
    # More frames than one read of the agent's holds (RECV_BYTES), and 6 s of backpressure
    # past the burst (200 frames waited 8 s for the same checks).
    n = 160
    frames = b"".join(protocol.encode_frame({"id": i, "cmd": "hello"}) for i in range(n))
    assert len(frames) > agent_server.RECV_BYTES
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


# ---------------------------------------------------------------- a client that reconnects
# Issue 27, finding 4: a client (same uid or root) sending 64 KiB deeply nested frames, each on
# a fresh connection, held a trainer to 0.15x its step rate: the depth check held the GIL
# 136 ms per frame, and the per-connection budgets and the CPU governor never counted it.

TRAINER_WITH_AGENT = """
import json, sys, threading, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_agent_limits import _probe
from memtop.agent.server import Agent
agent = Agent(_probe(), Path({directory!r}))
agent.start()
steps = 0
busy = {busy!r}
def train():
    # A step of Python work that holds the GIL, as a trainer's Python between kernels does; or,
    # where only the agent's own CPU is measured, a step that waits (a core spun for nothing
    # cost ~5 CPU-s a test).
    global steps
    while True:
        if busy:
            total = 0
            for i in range(20000):
                total += i
        else:
            time.sleep(0.01)
        steps += 1
        agent.on_step(explicit=True)
threading.Thread(target=train, daemon=True).start()
print(json.dumps({{"agent_tid": agent.thread_native_id}}), flush=True)
for line in sys.stdin:
    print(json.dumps({{"steps": steps, "governed_s": agent.governed_s}}), flush=True)
"""


class _Trainer:
    """A trainer process with an agent: its steps and its agent thread's CPU, read from here.
    `busy`: each step holds the GIL for Python work (the trainer's pace is what is measured);
    otherwise each step sleeps, and the agent's thread has the GIL whenever it asks."""

    def __init__(self, directory: Path, busy: bool) -> None:
        script = TRAINER_WITH_AGENT.format(
            tests=str(Path(__file__).parent), directory=str(directory), busy=busy
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=str(Path(__file__).parents[1]),
        )
        assert self.proc.stdout is not None
        self.agent_tid = json.loads(self.proc.stdout.readline())["agent_tid"]
        self.path = directory / f"{self.proc.pid}.sock"

    def state(self) -> dict[str, float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        return dict(json.loads(self.proc.stdout.readline()))

    def agent_cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/task/{self.agent_tid}/schedstat") as fh:
            return int(fh.read().split()[0]) / 1e9

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def busy_trainer(socket_dir: Path) -> Iterator[_Trainer]:
    running = _Trainer(socket_dir, busy=True)
    yield running
    running.close()


@pytest.fixture
def trainer(socket_dir: Path) -> Iterator[_Trainer]:
    # The governor's tests measure the agent thread's own CPU, not the trainer's pace: a
    # trainer spinning beside it (a core, ~5 CPU-s a test) only held the GIL from the agent,
    # which then spent less, never more (shares 0.8-2 % either way, bounds 4-5 %).
    running = _Trainer(socket_dir, busy=False)
    yield running
    running.close()


def _deep_frame(size: int = agent_server.MAX_REQUEST_BYTES) -> bytes:
    """A request as large as the agent reads, its args nested as deep as fits."""
    head, tail = b'{"id": 1, "cmd": "sample", "args": ', b"}"
    depth = (size - len(head) - len(tail)) // 2
    body = head + b"[" * depth + b"]" * depth + tail
    return struct.pack(">I", len(body)) + body


def _reconnect_and_send_deep_frames(path: Path, seconds: float, gap_s: float = 0.0) -> Counter[str]:
    """The attack: connect, send one deep frame, read the answer, reconnect; what came back."""
    frame = _deep_frame()
    seen: Counter[str] = Counter()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(0.1, min(2.0, deadline - time.monotonic())))
        try:
            sock.connect(str(path))
            with contextlib.suppress(OSError):  # refused unread: the agent hung up already
                sock.sendall(frame)
            reply = protocol.recv_message(sock)
            seen[reply.get("error", {}).get("code", "result")] += 1
        except (OSError, protocol.ProtocolError, protocol.ConnectionClosed) as exc:
            seen[type(exc).__name__] += 1
        finally:
            sock.close()
        time.sleep(gap_s)
    return seen


def _attack(path: Path, seconds: float, gap_s: float) -> None:
    """Two attackers at once, each sending a frame every `gap_s` at most."""
    attackers = [
        threading.Thread(target=_reconnect_and_send_deep_frames, args=(path, seconds, gap_s))
        for _ in range(2)
    ]
    for attacker in attackers:
        attacker.start()
    for attacker in attackers:
        attacker.join()


def _steps_in(trainer: _Trainer, seconds: float, attack: Callable[[], object] | None) -> int:
    before = trainer.state()["steps"]
    if attack is None:
        time.sleep(seconds)
    else:
        attack()
    return int(trainer.state()["steps"] - before)


def test_deep_frames_on_fresh_connections_leave_the_trainer_its_pace(busy_trainer: _Trainer):
    # Up to 100 connections a second, each with a 64 KiB frame nested 32 000 deep: the old check
    # held the GIL ~140 ms per frame and the trainer made 0.1-0.5x its steps.  Quiet and attacked
    # seconds alternate, so the box's own load weighs on both alike.
    trainer = busy_trainer
    quiet = attacked = 0
    for _ in range(3):
        quiet += _steps_in(trainer, 1.0, None)
        attacked += _steps_in(trainer, 1.0, lambda: _attack(trainer.path, 1.0, 0.02))
    assert quiet > 0 and attacked >= 0.6 * quiet, (attacked, quiet)


def test_a_client_that_reconnects_for_every_frame_is_governed_across_connections(
    trainer: _Trainer,
):
    # As fast as it can: every connection starts a fresh budget, so only the account of its uid
    # can bound what it costs.  A viewer connected before keeps its samples meanwhile.
    with AgentClient(trainer.proc.pid, trainer.path.parent, timeout=5) as polite:
        polite.connect()
        cpu_before, started = trainer.agent_cpu_s(), time.monotonic()
        seen: Counter[str] = Counter()
        attacker = threading.Thread(
            target=lambda: seen.update(_reconnect_and_send_deep_frames(trainer.path, 4.0))
        )
        attacker.start()
        samples = 0
        while attacker.is_alive():
            assert polite.sample().devices
            samples += 1
            time.sleep(0.25)
        attacker.join()
        share = (trainer.agent_cpu_s() - cpu_before) / (time.monotonic() - started)
    # Bounded by the governor at 0.5 % of a core plus what it lets through before it acts (1 %
    # measured); metered per connection only, 5-8 % of a core went to this client (19-31 %
    # when the depth check peeled brackets).
    assert share < 0.04, (share, seen)
    assert seen[protocol.E_RATE_LIMITED] >= 1, seen
    assert samples >= 8 and trainer.state()["governed_s"] > 0
    # Once the pause is over, a new viewer is served again.
    deadline = time.monotonic() + agent_server.GOVERN_MAX_PAUSE_S + 5
    while True:
        try:
            with AgentClient(trainer.proc.pid, trainer.path.parent, timeout=5) as client:
                client.connect()
                assert client.sample().devices
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_big_requests_under_the_rate_exemption_are_governed_by_what_they_cost(
    trainer: _Trainer,
):
    # Ten connections, up to 8 requests/s each (a dashboard's pace, under GOVERN_EXEMPT_RATE),
    # each request 60 KiB of small arrays: parsing them is what costs.  Metered by requests
    # alone, they were never paused and took ~14 % of a core.
    pad = [[1]] * 12_000
    frame = protocol.encode_frame({"id": 1, "cmd": "hello", "args": {"pad": pad}})
    answered: Counter[str] = Counter()

    def viewer() -> None:
        sock = _connect_to(trainer.path)
        deadline = time.monotonic() + 4.0
        try:
            while time.monotonic() < deadline:
                sock.sendall(frame)
                reply = protocol.recv_message(sock)
                answered["error" if "error" in reply else "result"] += 1
                time.sleep(0.125)
        finally:
            sock.close()

    cpu_before, started = trainer.agent_cpu_s(), time.monotonic()
    viewers = [threading.Thread(target=viewer) for _ in range(10)]
    for thread in viewers:
        thread.start()
    for thread in viewers:
        thread.join()
    share = (trainer.agent_cpu_s() - cpu_before) / (time.monotonic() - started)
    assert sum(answered.values()) >= 10, answered  # paused, not refused
    assert share < 0.05, (share, answered)


def _connect_to(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(15)
    sock.connect(str(path))
    return sock


def test_a_test_lowers_limits_through_the_environment_and_nothing_else_changes_them(
    monkeypatch: pytest.MonkeyPatch, socket_dir: Path
):
    from memtop.agent import limits_for_tests

    read = limits_for_tests.read
    assert read({}) == {}
    assert read(
        {"MEMTOP_AGENT_TEST_LIMITS": "snapshot_min_interval_s=0, connect_exempt_burst=1e9"}
    ) == {
        "snapshot_min_interval_s": 0.0,
        "connect_exempt_burst": 1e9,
    }
    # Unknown names, non-numbers, negative, infinite or NaN values and a zero share: ignored,
    # never raised into the trainer.
    for odd in (
        "idle_timeout_s=0",
        "cleanup_min_interval_s=-1",
        "cleanup_min_interval_s=inf",
        "cleanup_min_interval_s=nan",
        "cleanup_min_interval_s=²",
        "on_demand_max_share=0",
        "=",
        ",,,",
        "x" * 100_000,
    ):
        assert read({"MEMTOP_AGENT_TEST_LIMITS": odd}) == {}, odd
    # Read once, when the agent is made; unset, every limit is its default.
    monkeypatch.setenv(
        "MEMTOP_AGENT_TEST_LIMITS", "snapshot_min_interval_s=0,on_demand_max_share=1"
    )
    lowered = Agent(_probe(), socket_dir)
    assert lowered.commands.snapshot_cooldown.minimum == 0
    assert lowered.commands.snapshot_cooldown.max_share == 1
    monkeypatch.delenv("MEMTOP_AGENT_TEST_LIMITS")
    default = Agent(_probe(), socket_dir)
    assert default.commands.snapshot_cooldown.minimum == agent_server.SNAPSHOT_MIN_INTERVAL_S
    assert default._connect_exempt_burst == agent_server.CONNECT_EXEMPT_BURST


def test_the_agent_does_not_govern_its_own_start(socket_dir: Path, monkeypatch: pytest.MonkeyPatch):
    # The first sweep once came at the thread's start, where any CPU at all was over a share
    # of no time: the governor paused, and refused a dashboard's connections as churn.  The
    # share is raised here to 10 % of a core (50 ms a sweep): a first sweep at the start still
    # finds the start-up work over a share of no time, whatever the share, while a box running
    # two suites at once no longer makes the first connect and sample cost more than the default
    # 2.5 ms of the thread's CPU in the first half second (it governed 0.036 s there).
    monkeypatch.setattr(agent_server, "AGENT_MAX_CPU_SHARE", 0.1)
    agent = Agent(_probe(), socket_dir)
    agent.start()
    try:
        with AgentClient(agent.pid, agent.directory, timeout=5) as client:
            client.connect()
            assert client.sample().devices
        time.sleep(agent_server.SWEEP_INTERVAL_S * 1.5)
        assert agent.governed_s == 0.0
    finally:
        agent.stop()
