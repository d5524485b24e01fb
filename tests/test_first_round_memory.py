"""A dashboard's first round on trainers that have run for minutes (issue 35 item 8: RSS).

Each agent's first `sample` carries its backlog: MARK_WINDOW (1,024) step marks.  The `mixed`
demo's eleven agents answer it in the same round, and whatever that round holds at once is the
heap's high-water mark, which CPython does not give back (the process's RSS for good).  Parsed
into a record, a mapping and a float per mark, the backlogs held ~1.1 MB at once; decoded on the
pool's workers side by side, their JSON objects ~1.5 MB more.  Here: the marks parsed into
columns (model.StepMarks) that the store appends whole, and the replies decoded one at a time
(agent_client.PendingReply.wait_then)."""

from __future__ import annotations

import gc
import json
import socket
import subprocess
import sys
import threading
import tracemalloc
from array import array
from collections.abc import Callable

import pytest

from memtop import protocol
from memtop.engine.store import Ring, Store
from memtop.model import (
    MARK_WINDOW,
    AgentDevice,
    AgentHello,
    AgentStatus,
    AgentView,
    StepMark,
    StepMarks,
)
from memtop.sources.agent_client import AgentClient

GiB = 1 << 30
AGENTS = 11  # the mixed demo's


def _backlog_reply(pid: int, marks: int = MARK_WINDOW) -> dict[str, object]:
    """A first `sample` result as an agent of the mixed demo sends it (columns): a baseline that
    moves every step (a leaking trainer: no two marks alike), its resident set, glibc's free
    bytes once a second."""
    rows = [
        {
            "step": n,
            "time": 1_700_000_000.0 + n / 5,
            "allocated_bytes": {"0": 3 * GiB + pid * 4096 + n * 65_536},
            "host_rss_bytes": 900_000_000 + n * 4096,
            "host_heap_free_bytes": 2_000_000 + n if n % 5 == 0 else None,
        }
        for n in range(marks)
    ]
    stats = {
        "allocated_bytes.all.current": 3 * GiB + marks * 65_536,
        "reserved_bytes.all.current": 4 * GiB,
        "allocated_bytes.all.peak": 5 * GiB,
    }
    device = {"index": 0, "stats": stats, "free_bytes": 60 * GiB, "total_bytes": 80 * GiB}
    return {
        "time": 1_700_000_000.0 + marks / 5,
        "step": marks - 1,
        "devices": [device],
        "step_marks": [],
        "step_mark_columns": protocol.mark_columns(rows),
    }


def _hello(pid: int) -> AgentHello:
    device = AgentDevice(0, f"GPU-{pid:08d}", "Sim GPU", 80 * GiB)
    return AgentHello(1, pid, ("train.py",), "3.11", "2.13", "", (device,))


def _step_marks_alive() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is StepMark)


def _alone(measure: Callable[[], None]) -> None:
    """Run `measure` (a test's body) in an interpreter of its own: tracemalloc counts every
    thread's allocations and gc.get_objects every live object, so in an xdist worker the
    modules run before this one (a thread of theirs winding down, marks they still hold)
    would count as this round's (one failure in the whole suite, none alone)."""
    done = subprocess.run(
        [sys.executable, __file__, measure.__name__], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_first_rounds_backlogs_are_held_and_kept_as_columns() -> None:
    _alone(_first_rounds_backlogs_held_as_columns)


def _first_rounds_backlogs_held_as_columns() -> None:
    wires = {pid: json.dumps(_backlog_reply(pid)).encode() for pid in range(9001, 9001 + AGENTS)}
    protocol.parse_sample(json.loads(wires[9001]))  # what a first parse imports
    store = Store()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        # A round's samples are all held (the pool's inboxes, its records) until the store
        # has them; each reply decoded and parsed in turn, as the pool's workers do.
        polls = [
            AgentView(pid, AgentStatus.CONNECTED, _hello(pid), protocol.parse_sample(json.loads(w)))
            for pid, w in wires.items()
        ]
        marks_made = _step_marks_alive()
        with store.round():
            store.update_agents(polls, 1_700_000_300.0)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert marks_made == 0  # no record per mark: columns
    # A StepMark, a mapping and numbers per mark: 5.3 MB.  Columns: 1.1 MB (the marks, 11 × 40
    # KB; the store's rings, 22 × 24 KB; one reply's JSON objects, ~250 KB, gone once parsed).
    assert peak < 1_600_000, f"{peak / 1e6:.2f} MB at the peak of the round"
    # Every mark is in the store's rings, as the marks read one at a time would have put it.
    for pid in (9001, 9011):
        marks = polls[pid - 9001].sample.step_marks  # type: ignore[union-attr]
        kept = store.step_marks(pid, 0)
        assert kept["step"] == [float(m.step) for m in marks] == [float(n) for n in range(1024)]
        assert kept["allocated"] == [float(m.allocated[0]) for m in marks]
        assert kept["time"] == [m.time for m in marks]
        agent = store.agent(pid)
        assert agent is not None
        assert agent.sampled_peaks[0] == max(m.allocated[0] for m in marks)


def _client_with_reply(pid: int, reply: dict[str, object]) -> tuple[AgentClient, socket.socket]:
    """A client whose connection already holds `reply` to its first request (id 1), as an
    agent's first sample waits in the socket when a worker gets to it."""
    ours, agents = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    agents.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    agents.sendall(protocol.encode_frame({"id": 1, "result": reply}))
    ours.setblocking(False)
    client = AgentClient(pid)
    client._sock = ours
    return client, agents


def test_first_samples_waited_for_side_by_side_are_decoded_one_at_a_time() -> None:
    _alone(_first_samples_decoded_one_at_a_time)


def _first_samples_decoded_one_at_a_time() -> None:
    # The pool's workers each wait for an agent's first sample (AgentClient.sample); decoded
    # side by side, each reply's ~250 KB of JSON objects were held at once until parsed.
    pairs = [_client_with_reply(pid, _backlog_reply(pid)) for pid in range(9001, 9001 + 8)]
    samples: list[object] = []
    start = threading.Barrier(len(pairs))

    def worker(client: AgentClient) -> None:
        start.wait()
        samples.append(client.sample(timeout=60, max_marks=MARK_WINDOW, columns=True))

    threads = [threading.Thread(target=worker, args=(client,)) for client, _ in pairs]
    interval = sys.getswitchinterval()
    gc.collect()
    tracemalloc.start()
    try:
        # Threads switched as often as a loaded box switches them (the GIL held ~5 ms by one
        # otherwise: long enough to decode and parse a reply alone, as a quiet box seldom does).
        sys.setswitchinterval(1e-5)
        before = tracemalloc.get_traced_memory()[0]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        sys.setswitchinterval(interval)
        tracemalloc.stop()
        for client, agents in pairs:
            client.close()
            agents.close()
    assert len(samples) == len(pairs)
    assert all(len(s.step_marks) == MARK_WINDOW for s in samples)  # type: ignore[attr-defined]
    # One reply decoded at a time (~0.45 MB of JSON objects at its peak), beside the samples
    # already made (their columns, ~35 KB each) and, on a loaded box, every reply's bytes read
    # before the first is decoded (~50 KB each; reading is not serialised, decoding is): ~0.7 MB
    # on a quiet box, 1.01 MB seen under two suites at once; decoded side by side it was 4.0 MB.
    assert peak < 1_500_000, f"{peak / 1e6:.2f} MB at the peak of {len(pairs)} first samples"


@pytest.mark.parametrize("capacity", [1, 10, 64])
def test_a_ring_extended_keeps_the_rows_appends_would(capacity: int) -> None:
    extended, appended = Ring(capacity, ("a", "b")), Ring(capacity, ("a", "b"))
    n = 0
    for size in (0, 3, capacity - 1, 1, capacity, 2 * capacity + 5, 1, 0, capacity + 1, 2):
        window = extended.published()
        held = [list(window["a"]), list(window["b"])]
        rows = [float(v) for v in range(n, n + size)]
        n += size
        extended.extend(array("d", rows), array("d", [-v for v in rows]))
        for v in rows:
            appended.append(v, -v)
        assert extended.column("a") == appended.column("a")
        assert extended.column("b") == [-v for v in appended.column("a")]
        assert len(extended) == len(appended) <= capacity
        # A window published before holds its rows, whatever was written after.
        assert [list(window["a"]), list(window["b"])] == held


def test_step_marks_as_columns_read_as_the_marks_they_hold() -> None:
    rows = (
        StepMark(7, 1.5, {0: 10}, host_rss=100),
        StepMark(8, 2.0, {0: 11, 1: 5}, host_rss=None, host_heap_free=3),
        StepMark(9, 2.5, {1: 6}, host_rss=120, host_heap_free=4),
    )
    marks = StepMarks.of(rows)
    assert StepMarks.of(marks) is marks
    assert marks == rows and rows == marks and list(marks) == list(rows)
    assert marks[-1] == rows[2] and marks[1:] == rows[1:] and len(marks) == 3
    assert marks != rows[:2]
    with pytest.raises(IndexError):
        marks[3]
    # The store's rows of a device: the marks that have it, in doubles.
    assert [list(c) for c in marks.device_rows(1)] == [[8.0, 9.0], [2.0, 2.5], [5.0, 6.0]]
    assert [list(c) for c in marks.device_rows(0)] == [[7.0, 8.0], [1.5, 2.0], [10.0, 11.0]]
    assert [list(c) for c in marks.device_rows(2)] == [[], [], []]
    assert [list(c) for c in marks.host_rows()] == [[7.0, 9.0], [1.5, 2.5], [100.0, 120.0]]
    assert StepMarks.of(()) == () and list(StepMarks.of(()).host_rows()[0]) == []


if __name__ == "__main__":  # (_alone: one measurement, by its function's name)
    globals()[sys.argv[1]]()
