"""A sampling round reads every connected agent's `sample` on the poll thread, in one poll(2) set
(memtop.sources.agents.AgentPool._read_samples), and still keeps every promise a thread per
agent kept: a reply slower than the round is finished later, an agent that stops answering is
marked hung, and a hello gone stale is asked again before its sample is used."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from memtop.sources.agents import CONNECTED, HUNG, AgentPool

GiB = 1 << 30


def hello(devices: int) -> dict[str, object]:
    return {
        "protocol": 1,
        "pid": os.getpid(),
        "argv": ["train.py"],
        "python": "3.11",
        "torch": "2.13.0",
        "allocator_conf": "",
        "devices": [
            {"index": i, "uuid": f"GPU-{i}", "name": "H100", "total_bytes": 80 * GiB}
            for i in range(devices)
        ],
    }


def sample(step: int, devices: int) -> dict[str, object]:
    stats = {"allocated_bytes.all.current": GiB, "reserved_bytes.all.current": 2 * GiB}
    return {
        "time": time.time(),
        "step": step,
        "devices": [
            {"index": i, "stats": stats, "free_bytes": 70 * GiB, "total_bytes": 80 * GiB}
            for i in range(devices)
        ],
        "step_marks": [],
    }


def listen_as_agent(directory: Path, backlog: int = 1) -> socket.socket:
    """A listening socket where this process's agent would serve (SO_PEERCRED shows our pid,
    as the socket's name says)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(directory / f"{os.getpid()}.sock"))
    listener.listen(backlog)
    return listener


# How the agent answers its n-th sample (1-based): None never, else (pieces, gap s, devices).
Answer = Callable[[int], tuple[int, float, int] | None]


class Agent:
    """An agent in this process (SO_PEERCRED shows our pid, as its socket name says)."""

    def __init__(self, directory: Path, answer: Answer, hello_devices: Callable[[], int]) -> None:
        self.answer = answer
        self.hello_devices = hello_devices
        self.samples = 0
        self.hellos = 0
        self.listener = listen_as_agent(directory, 4)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.listener.accept()
                threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            while True:
                header = conn.recv(4, socket.MSG_WAITALL)
                if len(header) < 4:
                    return
                request = json.loads(conn.recv(int.from_bytes(header, "big"), socket.MSG_WAITALL))
                if request["cmd"] == "hello":
                    self.hellos += 1
                    self._send(conn, request["id"], hello(self.hello_devices()), 1, 0.0)
                    continue
                self.samples += 1
                how = self.answer(self.samples)
                if how is not None:
                    pieces, gap, devices = how
                    self._send(conn, request["id"], sample(self.samples, devices), pieces, gap)

    @staticmethod
    def _send(conn: socket.socket, rid: int, result: object, pieces: int, gap: float) -> None:
        body = json.dumps({"id": rid, "result": result}).encode()
        data = len(body).to_bytes(4, "big") + body
        size = -(-len(data) // pieces)
        for start in range(0, len(data), size):
            conn.sendall(data[start : start + size])
            time.sleep(gap)

    def close(self) -> None:
        self.listener.close()


def rounds(pool: AgentPool, count: int, budget: float, period: float) -> list[tuple[float, object]]:
    """`count` rounds `period` apart: (seconds the poll took, our agent's row) each."""
    out = []
    for _ in range(count):
        started = time.monotonic()
        mine = {p.pid: p for p in pool.poll(budget=budget)}.get(os.getpid())
        took = time.monotonic() - started
        out.append((took, mine))
        time.sleep(max(0.0, period - took))
    return out


def test_samples_after_the_first_are_read_on_the_poll_thread(socket_dir: Path) -> None:
    agent = Agent(socket_dir, lambda n: (1, 0.0, 1), lambda: 1)
    pool = AgentPool(socket_dir, timeout=1.0)
    replies: list[tuple[str, int, str]] = []
    pool.tap = lambda pid, cmd, result: replies.append(
        (cmd, result.get("step", 0), threading.current_thread().name)
    )
    try:
        seen = rounds(pool, 5, budget=0.5, period=0.1)
        assert all(row is not None and row.state == CONNECTED for _, row in seen)
        assert [row.sample.step for _, row in seen] == [1, 2, 3, 4, 5]  # type: ignore[union-attr]
        # The first round connects on a worker (hello, then its sample); the rest are read by
        # the thread that polls: no thread per agent per round.
        assert [cmd for cmd, _, _ in replies] == [
            "hello",
            "sample",
            "sample",
            "sample",
            "sample",
            "sample",
        ]
        assert {name for cmd, step, name in replies if step >= 2} == {"MainThread"}
        assert {name for cmd, _, name in replies[:2]} == {"memtop-agents"}
    finally:
        pool.close()
        agent.close()


def test_a_reply_slower_than_the_round_is_finished_later_and_not_lost(socket_dir: Path) -> None:
    # After the first sample every reply trickles in over 0.4 s: longer than a round's 0.25 s
    # budget, well within the request's 1 s deadline.
    agent = Agent(socket_dir, lambda n: (1, 0.0, 1) if n == 1 else (8, 0.05, 1), lambda: 1)
    pool = AgentPool(socket_dir, timeout=1.0)
    try:
        seen = rounds(pool, 10, budget=0.25, period=0.3)
        assert max(took for took, _ in seen) < 0.25 + 0.15  # every round ends on time
        rows = [row for _, row in seen]
        assert all(row is not None and row.state == CONNECTED for row in rows)
        steps = [row.sample.step for row in rows if row.sample is not None]  # type: ignore[union-attr]
        assert len(steps) >= 5 and steps == sorted(set(steps))  # each arrives, once, in order
        assert steps[0] == 1 and agent.samples - steps[-1] <= 2  # none lost on the way
    finally:
        pool.close()
        agent.close()


def test_an_agent_that_stops_answering_mid_run_is_marked_hung(socket_dir: Path) -> None:
    agent = Agent(socket_dir, lambda n: (1, 0.0, 1) if n <= 3 else None, lambda: 1)
    pool = AgentPool(socket_dir, timeout=0.6)
    try:
        seen = rounds(pool, 12, budget=0.2, period=0.25)
        states = [row.state for _, row in seen if row is not None]
        assert states[:3] == [CONNECTED] * 3
        assert HUNG in states, states
        hung = next(row for _, row in seen if row is not None and row.state == HUNG)
        assert "no reply to 'sample' within 0.6 s" in (hung.error or "")  # type: ignore[attr-defined]
        assert max(took for took, _ in seen) < 0.2 + 0.15
    finally:
        pool.close()
        agent.close()


def test_a_timeout_is_named_as_it_was_given_however_late_the_request_is_sent(
    socket_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A loaded box pauses the client between setting a request's deadline and sending it; the
    # message once said what was left then ("within 0.599 s" for a 0.6 s timeout).  Here every
    # clock read is 2 ms later than the one before.
    from memtop.sources import agent_client

    skew = [0.0]

    def late_monotonic() -> float:
        skew[0] += 0.002
        return time.monotonic() + skew[0]

    agent = Agent(socket_dir, lambda n: None, lambda: 1)
    client = agent_client.AgentClient(os.getpid(), socket_dir, timeout=0.6)
    try:
        client.connect()
        monkeypatch.setattr(agent_client, "time", types.SimpleNamespace(monotonic=late_monotonic))
        for ask in (lambda: client.request("sample"), lambda: client.send("sample").wait()):
            with pytest.raises(agent_client.AgentTimeout, match=r"within 0\.6 s$"):
                ask()
            client.close()
            client.connect()
    finally:
        client.close()
        agent.close()


def test_a_hello_gone_stale_is_asked_again_before_its_sample_is_used(socket_dir: Path) -> None:
    # CUDA starts on a second device after the agent said hello: its samples carry cuda:1.
    devices = {"now": 1}
    agent = Agent(socket_dir, lambda n: (1, 0.0, 1 if n <= 2 else 2), lambda: devices["now"])
    pool = AgentPool(socket_dir, timeout=1.0)
    try:
        first = rounds(pool, 2, budget=0.5, period=0.1)
        devices["now"] = 2
        later = rounds(pool, 3, budget=0.5, period=0.1)
        rows = [row for _, row in first + later]
        assert all(row is not None and row.state == CONNECTED for row in rows), [
            (row.state, row.error)
            for row in rows
            if row is not None  # type: ignore[attr-defined]
        ]
        assert agent.hellos == 2  # once on connecting, once when cuda:1 appeared
        assert len(rows[-1].hello.devices) == 2  # type: ignore[union-attr]
    finally:
        pool.close()
        agent.close()


def test_a_request_to_an_agent_that_reads_late_waits_for_its_own_deadline(
    socket_dir: Path,
) -> None:
    # The agent stops reading for 0.4 s (its buffer fills with our requests), then catches
    # up. A request that cannot be sent at once waits up to its own deadline; it neither
    # fails early (no stale timeout left on the socket by an earlier request) nor hangs.
    listener = listen_as_agent(socket_dir)
    reading = threading.Event()
    reading.set()

    def serve() -> None:
        conn, _ = listener.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        with contextlib.suppress(OSError), conn:
            while True:
                reading.wait()
                header = conn.recv(4, socket.MSG_WAITALL)
                if len(header) < 4:
                    return
                request = json.loads(conn.recv(int.from_bytes(header, "big"), socket.MSG_WAITALL))
                result = hello(1) if request["cmd"] == "hello" else {"pad": "x" * 200}
                body = json.dumps({"id": request["id"], "result": result}).encode()
                conn.sendall(len(body).to_bytes(4, "big") + body)

    threading.Thread(target=serve, daemon=True).start()
    from memtop.sources.agents import AgentClient, AgentTimeout

    client = AgentClient(os.getpid(), socket_dir, timeout=3.0)
    try:
        client.connect()
        client.request("ping_a")  # unknown commands still get an answer here: a result
        reading.clear()
        threading.Timer(0.4, reading.set).start()
        started = time.monotonic()
        padding = {"pad": "y" * 60_000}
        pending = [client.send("echo", padding, time.monotonic() + 3.0) for _ in range(8)]
        assert [p.wait()["pad"] for p in pending] == ["x" * 200] * 8
        assert time.monotonic() - started >= 0.35  # they did wait for the agent to read
        # An agent that never reads again: the send fails at its deadline, not before.
        reading.clear()
        started = time.monotonic()
        try:
            for _ in range(64):
                client.send("echo", padding, time.monotonic() + 0.5)
        except AgentTimeout:
            waited = time.monotonic() - started
        else:
            raise AssertionError("64 sends of 60 kB into a socket nobody reads all went out")
        assert 0.45 <= waited < 2.0
    finally:
        reading.set()
        client.close()
        listener.close()


def test_an_agent_that_stops_reading_its_requests_never_holds_up_the_round(
    socket_dir: Path,
) -> None:
    # The poll thread sends every agent's sample in turn: one whose socket takes no more
    # (it stopped reading) fails at once instead of holding the round to its deadline.
    listener = listen_as_agent(socket_dir)
    resume = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with contextlib.suppress(Exception), conn:
            step = 0
            while True:
                if step == 2:  # hello and two samples answered: it stops reading
                    resume.wait()
                header = conn.recv(4, socket.MSG_WAITALL)
                if len(header) < 4:
                    return
                request = json.loads(conn.recv(int.from_bytes(header, "big"), socket.MSG_WAITALL))
                if request["cmd"] == "hello":
                    result = hello(1)
                else:
                    step += 1
                    result = sample(step, 1)
                body = json.dumps({"id": request["id"], "result": result}).encode()
                conn.sendall(len(body).to_bytes(4, "big") + body)

    threading.Thread(target=serve, daemon=True).start()
    pool = AgentPool(socket_dir, timeout=2.0)
    try:
        seen = rounds(pool, 2, budget=0.3, period=0.1)
        assert all(row is not None and row.state == CONNECTED for _, row in seen)
        sock = pool._agents[os.getpid()].client._sock  # type: ignore[union-attr]
        with contextlib.suppress(BlockingIOError):
            while True:  # what an agent that stopped reading leaves: a full socket
                sock.send(b"\0" * 65536)  # type: ignore[union-attr]
        took, row = rounds(pool, 1, budget=0.3, period=0.0)[0]
        assert took < 0.3
        assert row is not None and row.state == HUNG
        assert "does not read its requests" in (row.error or "")  # type: ignore[attr-defined]
    finally:
        resume.set()
        pool.close()
        listener.close()


def test_once_reports_an_agent_whose_first_request_is_still_out_when_the_rounds_end(
    socket_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A silent agent (its connection waits in the backlog, its hello is never answered) is
    # called hung once its request's deadline passes.  On a loaded box that request started
    # late, the rounds of `--once` ended first, and the report left the agent out.  Here the
    # rounds are cut short as the load did.
    from memtop import cli
    from memtop.engine.sampler import Sampler

    monkeypatch.setattr(Sampler, "round_budget", lambda self: 0.2)
    monkeypatch.setenv("MEMTOP_SOCKET_DIR", str(socket_dir))
    listener = listen_as_agent(socket_dir, 4)
    try:
        assert cli.main(["--once", "--json"]) == 0
    finally:
        listener.close()
    (mine,) = [a for a in json.loads(capsys.readouterr().out)["agents"] if a["pid"] == os.getpid()]
    assert mine["state"] == "hung" and "no reply to 'hello'" in mine["error"]


def test_a_reply_of_printable_ascii_is_not_walked_to_clean_it(
    socket_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every reply's strings went through protocol.clean_value, a walk of the whole reply in
    # Python (~20 µs a steady sample, every agent every second) that changed nothing in a frame
    # of printable ASCII without escapes (protocol.text.inert_json).  A frame with anything else
    # is still walked, and cleaned.
    import sys

    from memtop import protocol

    walks: list[object] = []
    real_clean_value = protocol.clean_value

    def counting(value: object) -> object:
        walks.append(value)
        return real_clean_value(value)

    monkeypatch.setattr(protocol, "clean_value", counting)
    plain = sys.modules[__name__].sample

    def with_escape(step: int, devices: int) -> dict[str, object]:
        result = plain(step, devices)
        if step >= 4:
            stats = result["devices"][0]["stats"]  # type: ignore[index]
            stats["\x1b[2Jnum_ooms"] = 0
        return result

    monkeypatch.setattr(sys.modules[__name__], "sample", with_escape)
    agent = Agent(socket_dir, lambda n: (1, 0.0, 1), lambda: 1)
    pool = AgentPool(socket_dir, timeout=1.0)
    try:
        seen = rounds(pool, 5, budget=0.5, period=0.1)
    finally:
        pool.close()
        agent.close()
    samples = [row.sample for _, row in seen if row is not None and row.sample is not None]
    assert [s.step for s in samples] == [1, 2, 3, 4, 5]
    assert len(walks) == 2, walks  # the samples with the escape (json.dumps wrote \u001b)
    assert "?[2Jnum_ooms" in samples[-1].devices[0].stats


def test_a_steady_round_makes_no_selector_and_no_future_per_agent(
    socket_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every agent every second: a `selectors` selector a round (an epoll made and closed, two
    # epoll_ctl calls per agent) and a Future (a lock and a condition) per agent to say "done"
    # were ~1/8 of the poll thread's work.  The replies are read as before.
    import selectors
    from concurrent.futures import Future

    from memtop.sources import agents

    made = {"selectors": 0, "futures": 0}

    class CountedSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            made["selectors"] += 1
            super().__init__()

    class CountedFuture(Future):  # type: ignore[type-arg]
        def __init__(self) -> None:
            made["futures"] += 1
            super().__init__()

    agent = Agent(socket_dir, lambda n: (1, 0.0, 2), lambda: 2)
    pool = AgentPool(socket_dir, timeout=1.0)
    try:
        rounds(pool, 2, budget=0.5, period=0.05)  # connected (on a worker)
        monkeypatch.setattr(selectors, "DefaultSelector", CountedSelector)
        monkeypatch.setattr(agents, "Future", CountedFuture)
        seen = rounds(pool, 5, budget=0.5, period=0.05)
        assert [row.sample.step for _, row in seen] == [3, 4, 5, 6, 7]  # type: ignore[union-attr]
        assert made == {"selectors": 0, "futures": 0}
    finally:
        pool.close()
        agent.close()
