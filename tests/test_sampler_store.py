"""The store's ring buffers and bookkeeping, and the sampler against real trainer processes."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
import tracemalloc
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from memtop.engine.sampler import Sampler
from memtop.engine.store import Ring, Store
from memtop.model import (
    MARK_WINDOW,
    AgentCleanup,
    AgentDeviceSample,
    AgentHello,
    AgentResetPeak,
    AgentSample,
    DeviceReading,
    DriverReading,
    HostMemory,
    StepMark,
    search_column,
)
from memtop.sim.demo import Demo
from memtop.sources.agents import CONNECTED, EXITED, AgentClient, AgentPool, AgentView
from memtop.sources.devices import DefaultDeviceSource

MiB = 1 << 20


def test_ring_keeps_the_newest_rows_in_order():
    ring = Ring(3, ("t", "v"))
    assert ring.last("v") is None and ring.column("v") == []
    for i in range(5):
        ring.append(i, i * 10)
    assert len(ring) == 3
    assert ring.column("t") == [2, 3, 4]
    assert ring.column("v", last=2) == [30, 40]
    assert ring.last("v") == 40


def test_a_window_is_a_copy_of_the_column_wrapped_or_not():
    ring = Ring(4, ("t", "v"))
    for i in range(6):  # wrapped: rows 2..5, the oldest at slot 2
        ring.append(i, i * 10)
        for last in (None, 0, 1, 3, 4, 9):
            assert list(ring.window("v", last)) == ring.column("v", last)
    window = ring.window("v")
    ring.append(6, 60)
    assert list(window) == [20, 30, 40, 50]  # a copy: later rows do not show through


def poll(
    pid: int,
    step: int,
    allocated: int,
    marks: tuple[StepMark, ...] = (),
    when: float | None = None,
) -> AgentView:
    stats = {"allocated_bytes.all.current": allocated, "reserved_bytes.all.current": 2 * allocated}
    hello = AgentHello(1, pid, ("train.py",), "3.11", None, "", ())
    sample = AgentSample(
        time=time.time() if when is None else when,
        step=step,
        devices=(AgentDeviceSample(0, stats, 1000, 2000),),
        step_marks=marks,
    )
    return AgentView(pid, CONNECTED, hello, sample)


def _gpu(used: int) -> DriverReading:
    return DriverReading(True, (DeviceReading(0, "GPU-0", "sim", 1 << 40, used),))


def _written_round(store: Store, n: int) -> None:
    """Round `n`: a GPU's used bytes, two agents' samples (time n) and one step mark each."""
    with store.round():
        store.update_driver(_gpu(n), when=float(n))
        store.update_agents(
            [poll(pid, n, n, (StepMark(n, float(n), {0: n}),), when=float(n)) for pid in (7, 8)],
            when=float(n),
        )


def _newest(n: int, kept: int) -> list[float]:
    """The rows 1..n a ring of `kept` rows holds after round n."""
    return [float(i) for i in range(max(1, n - kept + 1), n + 1)]


def test_a_reader_of_an_old_generation_never_sees_a_newer_row():
    # Rings of 8 rows, written for 60 rounds: full, then compacted several times over while
    # every generation's view is held.
    store = Store(history=8, step_marks=8)
    views = []
    for n in range(1, 61):
        _written_round(store, n)
        views.append((n, store.view()))
    for n, view in views:
        times, used = view.used_window("GPU-0")
        assert list(times) == list(used) == _newest(n, 8)
        for pid in (7, 8):
            rows, marks = view.windows(pid, 0)
            assert list(rows["time"]) == list(rows["allocated"]) == _newest(n, 8)
            assert list(marks["step"]) == list(marks["allocated"]) == _newest(n, 8)
            # Cut, indexed, searched: the same rows whichever way they are read.
            assert list(rows["time"][-3:]) == _newest(n, 3)
            assert rows["time"][-1] == n and rows["time"][0] == _newest(n, 8)[0]
            assert bisect_left(rows["time"], n) == len(rows["time"]) - 1
            for value in (0.0, n - 2.5, n - 1.0, n + 1.0):
                for right in (False, True):
                    searched = (bisect_right if right else bisect_left)(list(rows["time"]), value)
                    assert search_column(rows["time"], value, right) == searched
            assert view.host_window(pid) == ({}, {})


def test_a_view_read_while_the_sampler_writes_holds_its_own_round():
    """The sampler writes rounds on its thread while a reader holds and reads the views it
    took (the dashboard's threads): each view reads as its round, then and later."""
    store = Store(history=16, step_marks=16)
    _written_round(store, 1)
    stop = threading.Event()
    written = [1]

    def sampler() -> None:
        n = 1
        while not stop.is_set() and n < 20_000:
            n += 1
            _written_round(store, n)
            written[0] = n

    thread = threading.Thread(target=sampler)
    thread.start()
    held = []
    try:
        while thread.is_alive() and len(held) < 300:
            view = store.view()
            times = view.windows(7, 0)[0]["time"]
            newest = int(times[-1])
            assert list(times) == _newest(newest, 16)  # read at once
            held.append((newest, view))
            time.sleep(0.001)
    finally:
        stop.set()
        thread.join()
    assert written[0] > 100 and len({newest for newest, _ in held}) > 10
    for newest, view in held:  # read again, rounds (and compactions) later
        rows, marks = view.windows(8, 0)
        assert list(rows["allocated"]) == list(marks["step"]) == _newest(newest, 16)
        assert list(view.used_window("GPU-0")[1]) == _newest(newest, 16)


def test_a_round_s_view_copies_no_rows_of_history():
    """The view of a round holds where its windows' rows lie, not copies of them: a reader
    cuts what it reads (the diagnosis ~900 rows of a few columns, a screen its marks).  It
    copied every column of every window every round: ~1 MB at 3 minutes of the mixed demo."""
    store = Store(history=600)
    for n in range(1, 601):
        with store.round():
            store.update_driver(_gpu(n), when=float(n))
            store.update_agents(
                [
                    poll(pid, n, n, (StepMark(n, float(n), {0: n}),), when=float(n))
                    for pid in range(8)
                ],
                when=float(n),
            )
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        view = store.view()
        grown = sum(
            stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename")
        )
    finally:
        tracemalloc.stop()
    # 8 devices × 9 columns × 600 rows of doubles were 345 kB, and the marks 115 kB more.
    assert grown < 24_000, f"the view took {grown} bytes"
    rows, marks = view.windows(3, 0)
    assert len(rows["time"]) == 600 and list(marks["step"][-2:]) == [599.0, 600.0]


def test_a_store_keeps_the_step_marks_its_readers_read_and_no_more():
    """Every reader reads the newest MARK_WINDOW step marks (the leak test, the screens, a
    report); the store kept 4096 per device and per host memory, which a trainer stepping a
    few times a second filled in minutes: the dashboard grew by ~1.6 MB as the demo aged."""
    store = Store()
    memory = HostMemory(rss_bytes=1, peak_rss_bytes=1, total_bytes=1 << 30)
    for n in range(1, 3001):
        marks = (StepMark(n, float(n), {0: n}, host_rss=n),)
        sampled = poll(7, n, n, marks, when=float(n))
        sampled = replace(sampled, sample=replace(sampled.sample, host_memory=memory))
        store.update_agents([sampled], when=float(n))
    newest = [float(n) for n in range(3001 - MARK_WINDOW, 3001)]
    assert store.step_marks(7, 0)["step"] == newest
    view = store.view()
    assert list(view.windows(7, 0)[1]["allocated"]) == newest  # what the readers read, as before
    assert list(view.host_window(7)[1]["rss"]) == newest
    rings = store._rings[7]
    for marks_ring in (rings.devices[0][1], rings.host_marks):
        assert marks_ring is not None
        held = sum(column.buffer_info()[1] * column.itemsize for column in marks_ring._columns)
        assert held <= 1.2 * MARK_WINDOW * 3 * 8, f"{held} bytes held for {MARK_WINDOW} marks"


def test_store_tracks_peaks_marks_and_resets():
    store = Store()
    store.update_agents([poll(7, 1, 100 * MiB)])
    marks = (StepMark(2, time.time(), {0: 300 * MiB}), StepMark(3, time.time(), {0: 120 * MiB}))
    store.update_agents([poll(7, 3, 150 * MiB, marks)])
    (agent,) = store.agents()
    assert agent.step == 3
    assert agent.sampled_peak(0) == 300 * MiB  # a step baseline counts
    assert store.step_marks(7, 0)["allocated"] == [300 * MiB, 120 * MiB]
    assert store.history(7, 0)["allocated"] == [100 * MiB, 150 * MiB]
    store.reset_peak(7)
    assert store.agent(7).sampled_peak(0) == 150 * MiB  # type: ignore[union-attr]


def test_store_marks_exited_agents_then_forgets_them():
    store = Store(keep_exited_s=0.0)
    store.update_agents([poll(7, 1, MiB)])
    store.update_agents([AgentView(7, EXITED, None, error="process exited")], when=time.time() + 1)
    assert store.agents() == []
    assert any("agent 7 exited" in message for _, message in store.events)


def test_store_keeps_device_history_by_uuid():
    from memtop.model import DeviceReading

    store = Store()
    for used in (1, 2, 3):
        reading = DriverReading(True, (DeviceReading(0, "GPU-a", "g", 10, used),))
        store.update_driver(reading, when=float(used))
    assert store.device_used_history("GPU-a") == [(1.0, 1.0), (2.0, 2.0), (3.0, 3.0)]


@pytest.fixture
def demo() -> Iterator[Demo]:
    directory = Path(tempfile.mkdtemp(prefix="mts-"))
    directory.chmod(0o700)
    running = Demo(gpus=2, scenario="healthy", step_time=0.05, socket_dir=directory)
    running.start()
    assert running.wait_ready(30)
    # The agent measures breakdowns and runs actions at step boundaries: wait for the first.
    deadline = time.monotonic() + 30
    for process in running.processes:
        with AgentClient(process.pid, directory, timeout=5) as client:
            client.connect()
            while not client.sample().step and time.monotonic() < deadline:
                time.sleep(0.05)
    yield running
    running.stop()


@pytest.mark.slow
def test_sampler_joins_devices_and_agents_and_notices_exits(demo: Demo):
    directory = demo.socket_dir
    store = Store()
    sampler = Sampler(
        store, DefaultDeviceSource(directory, simulated_only=True), AgentPool(directory)
    )
    sampler.sample_once()

    # A breakdown is measured at the trainer's next step ("pending" first): a few rounds on a
    # quiet box; a loaded one (two suites at once on two slow cores) took more than 40.  The
    # wait is for what is asserted below (each agent's device measured, with its parameters),
    # and its deadline a guard against a hang: 30 s was not enough once with two suites at once.
    def measured(agent: AgentView) -> bool:
        index = agent.devices[0].index if agent.devices else None
        part = (agent.breakdown or {}).get(index) if index is not None else None
        return isinstance(part, dict) and (part.get("parameters") or 0) > 0

    deadline = time.monotonic() + 90
    while not all(map(measured, store.agents())) and time.monotonic() < deadline:
        time.sleep(0.05)
        sampler.sample_once()
    reading = store.driver()
    assert reading is not None and reading.available and reading.source == "sim"
    assert len(reading.devices) == 2
    agents = store.agents()
    assert {a.pid for a in agents} == {p.pid for p in demo.processes}
    assert all(a.state == CONNECTED for a in agents)
    uuids = {d.uuid for d in reading.devices}
    assert {a.device_identity(a.devices[0].index)[0] for a in agents} == uuids
    assert all(map(measured, agents)), [(a.pid, a.breakdown) for a in agents]

    victim = demo.processes[0]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    sampler.sample_once()
    states = {a.pid: a.state for a in store.agents()}
    assert states[victim.pid] == EXITED
    assert states[demo.processes[1].pid] == CONNECTED
    sampler.stop()


@pytest.mark.slow
def test_sampler_thread_and_an_action(demo: Demo):
    directory = demo.socket_dir
    store = Store()
    sampler = Sampler(
        store,
        DefaultDeviceSource(directory, simulated_only=True),
        AgentPool(directory),
        interval=0.1,
    )
    sampler.start()
    pid = demo.processes[0].pid
    # Rounds whose reply from a loaded trainer came too late keep no row: wait for the rows.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (
        sampler.rounds < 5 or len(store.history(pid, 0).get("allocated", [])) < 4
    ):
        time.sleep(0.05)
    assert sampler.rounds >= 5
    assert len(store.history(pid, 0)["allocated"]) >= 4
    result = sampler.run_action(pid, "cleanup").result(timeout=15)
    assert result["released_bytes"]["0"] >= 0
    assert result["at_step_boundary"] is True
    sampler.pause(True)
    time.sleep(0.3)  # a round already under way may finish
    paused_at = sampler.rounds
    time.sleep(0.4)
    assert sampler.rounds == paused_at
    sampler.stop()


@pytest.mark.slow
def test_an_action_comes_back_as_a_typed_reply_and_its_consequence_is_the_feeds(demo: Demo):
    directory = demo.socket_dir
    store = Store()
    sampler = Sampler(
        store, DefaultDeviceSource(directory, simulated_only=True), AgentPool(directory)
    )
    try:
        sampler.sample_once()
        pid = demo.processes[0].pid
        cleanup = sampler.act(pid, "cleanup").result(timeout=15)
        assert cleanup.ok and cleanup.wire["at_step_boundary"] is True
        parsed = cleanup.parsed_as(AgentCleanup)
        assert parsed is not None and 0 in parsed.released_bytes  # by device, as numbers
        assert cleanup.parsed_as(AgentResetPeak) is None

        written = store.generation  # nothing samples meanwhile: only the action writes
        reset = sampler.act(pid, "reset_peak").result(timeout=15)
        assert reset.ok and reset.parsed_as(AgentResetPeak) is not None
        assert store.generation > written  # the feed restarted its sampled peak itself

        # A pid with no agent: the reply says why, the future does not raise.
        missing = sampler.act(999_999_999, "cleanup", timeout=1.0).result(timeout=5)
        assert not missing.ok and missing.error
        # A pid neither the driver lists nor an authenticated agent serves is never signalled.
        refused = sampler.signal(999_999_999, signal.SIGTERM, None)
        assert refused.error and "never verified" in refused.error
    finally:
        sampler.stop()


def test_a_foreign_or_open_socket_dir_is_reported_not_used(socket_dir: Path):
    from memtop.engine.observation import observe
    from memtop.present import report

    socket_dir.chmod(0o777)
    store = Store()
    sampler = Sampler(
        store, DefaultDeviceSource(socket_dir, simulated_only=True), AgentPool(socket_dir)
    )
    sampler.sample_once()
    sampler.stop()
    (problem,) = store.problems()
    assert "world-writable" in problem and str(socket_dir) in problem
    text = report.render_text(report.build(observe(store)))
    assert f"! ignoring agents: socket directory {socket_dir}" in text


def test_device_reads_share_one_thread_and_recover_after_a_hang() -> None:
    import threading

    from memtop.engine.sampler import IsolatedDevices

    class Source:
        def __init__(self) -> None:
            self.threads: set[int] = set()
            self.gate = threading.Event()
            self.gate.set()
            self.reads = 0

        def read(self) -> DriverReading:
            self.threads.add(threading.get_ident())
            self.gate.wait(10)
            self.reads += 1
            return DriverReading(available=False, error=f"read {self.reads}")

        def close(self) -> None:
            self.gate.set()

    source = Source()
    devices = IsolatedDevices(source)  # type: ignore[arg-type]
    try:
        assert [devices.read(1.0).error for _ in range(3)] == ["read 1", "read 2", "read 3"]
        assert len(source.threads) == 1  # one long-lived worker, not a thread per round
        source.gate.clear()  # the driver wedges
        assert devices.read(0.05).error == "read 3"  # the last reading stands in
        assert devices.stalled_since is not None
        # ... and no second read is asked meanwhile, nor is the one in flight waited for again:
        # with the driver wedged, each round's budget is the agents'.
        asked = time.monotonic()
        assert devices.read(5.0).error == "read 3"
        assert time.monotonic() - asked < 1.0
        source.gate.set()
        time.sleep(0.1)
        assert devices.read(1.0).error == "read 4" and devices.stalled_since is None
        assert devices.read(1.0).error == "read 5" and len(source.threads) == 1
    finally:
        devices.close()
