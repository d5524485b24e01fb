"""One record per entity from an agent's reply to a table cell (issue 35 item 4).

The figure a process table cell shows (`allocated` of an agent's device) is parsed once into
the sample's record and then only held by reference: the store's one record of the device (no
writer's twin, no reader's copy), the device's one record above the store (made once, where the
join places it, with its job's peers: no copy placed, no copy ranked), and the process's one
row (the join's record is the table's).  Each assertion below walks that path back from the row
the dashboard draws to the reply's record, by identity, so a copy made on the way fails it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from memtop.engine import observation as observation_module
from memtop.engine.observation import Observer, ProcessRow
from memtop.engine.store import Store
from memtop.model import (
    AgentBreakdown,
    AgentDevice,
    AgentDeviceSample,
    AgentHello,
    AgentSample,
    AgentStatus,
    AgentView,
    DeviceReading,
    DriverReading,
    GpuProcess,
    ProcessInfo,
)
from memtop.sim.demo import Demo
from memtop.sources.agents import AgentPool
from memtop.ui import view

GiB = 1 << 30
UID = 1000


def _hello(pid: int, rank: int) -> AgentHello:
    return AgentHello(
        protocol=1,
        pid=pid,
        argv=("python", "train.py"),
        python="3.12",
        torch="2.13",
        allocator_conf="",
        devices=(AgentDevice(0, f"GPU-{pid}", "H100", 80 * GiB),),
        extra={"rank": rank, "world_size": 2, "scheduler": {"kind": "slurm", "job_id": "9"}},
    )


def _sample(peak: int) -> AgentSample:
    stats = {
        "allocated_bytes.all.current": peak // 2,
        "reserved_bytes.all.current": peak,
        "allocated_bytes.all.peak": peak,
    }
    return AgentSample(10.0, 5, (AgentDeviceSample(0, stats, 70 * GiB, 80 * GiB),))


def _round() -> tuple[Store, Observer, dict[int, AgentSample], dict[int, AgentView]]:
    store = Store()
    samples = {101: _sample(40 * GiB), 102: _sample(20 * GiB)}
    devices = tuple(
        DeviceReading(i, f"GPU-{pid}", "H100", 80 * GiB, samples[pid].devices[0].reserved + GiB)
        for i, pid in enumerate(samples)
    )
    devices = tuple(
        dataclasses.replace(d, processes=(GpuProcess(pid, d.used_bytes),))
        for d, pid in zip(devices, samples, strict=True)
    )
    with store.round():
        store.update_driver(DriverReading(True, devices, "550"), when=10.0)
        store.update_processes(
            {pid: ProcessInfo(pid, UID, "ann", ("python", "train.py"), "python") for pid in samples}
        )
        polls = {
            pid: AgentView(pid, AgentStatus.CONNECTED, _hello(pid, rank), samples[pid])
            for rank, pid in enumerate(samples)
        }
        store.update_agents(polls.values(), when=10.0)
    return store, Observer(store, clock=lambda: 10.0, host="box", uid=UID), samples, polls


def test_the_reply_s_record_is_held_by_reference_from_the_store_to_the_row() -> None:
    store, observer, samples, polls = _round()
    obs = observer.latest()
    dash = view.build(obs)
    for pid, sample in samples.items():
        reply_record = sample.devices[0]
        # The store keeps one record per agent: the poll's record itself (no store's record
        # beside the pool's), holding the parsed sample; no copy per reader.
        kept = store.agent(pid)
        assert kept is polls[pid] and kept is store.agent(pid)
        assert kept.sample is sample and kept.kept
        # The device's record in it is the reply's record itself: no wrapper per device.
        assert kept.devices[0] is reply_record
        assert kept.device_identity(0) == (f"GPU-{pid}", "H100")
        assert kept.sampled_peak(0) == reply_record.allocated
        # The round hands out the kept records themselves, its windows beside them.
        round_view = store.view()
        assert round_view.agents[list(samples).index(pid)] is kept
        assert list(round_view.windows(pid, 0)[0]["allocated"]) == [reply_record.allocated]
        # The observation's agent is the store's record itself (no observation's copy of it).
        assert obs.agent(pid) is kept
        assert obs.agents[list(samples).index(pid)] is kept
        # The device's one record above the store: the diagnosis, the agent's and the GPU's.
        device = obs.diagnosis.devices[(pid, 0)]
        assert obs.device(pid, 0) is device and obs.devices_of(kept) == (device,)
        assert any(d is device for g in obs.gpus for d in g.agents)
        assert device.sample is reply_record
        # Placed by the join as it was made: the driver's UUID, number and charge.
        assert device.uuid == f"GPU-{pid}" and device.nvml_used_bytes == reply_record.reserved + GiB
        # The process's one row: the join's record is the one the dashboard draws.
        row = next(r for r in obs.entries if r.pid == pid)
        assert next(r for r in dash.processes if r.pid == pid) is row
        assert isinstance(row, ProcessRow) and view.ProcessRow is ProcessRow
        assert row.agent_device is device and row.allocated == reply_record.allocated
        assert row.agent is kept


def test_the_table_draws_the_row_itself_with_no_rich_text_between(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last hop: the process table's line is the observation's row itself, drawn straight
    into Textual's segments (no Rich `Text` made for it, a round or a draw)."""
    import asyncio

    from rich.text import Text
    from textual.app import App, ComposeResult

    from memtop.figures.units import short_bytes
    from memtop.ui.widgets.process_table import ProcessTable

    _, observer, samples, _ = _round()
    obs = observer.latest()
    dash = view.build(obs)

    class One(App[None]):
        def compose(self) -> ComposeResult:
            yield ProcessTable()

    made: list[Text] = []
    init = Text.__init__

    def counted(self: Text, *args: object, **kwargs: object) -> None:
        made.append(self)
        init(self, *args, **kwargs)  # type: ignore[arg-type]

    async def run() -> list[str]:
        app = One()
        async with app.run_test(size=(120, 8)) as pilot:
            table = app.query_one(ProcessTable)
            await pilot.pause()
            monkeypatch.setattr(Text, "__init__", counted)
            table.show(dash.processes, compact=False, renew=True)
            drawn = ["".join(s.text for s in table.render_line(y + 1)) for y in range(2)]
            monkeypatch.undo()
            for pid, sample in samples.items():
                row = next(r for r in obs.entries if r.pid == pid)
                line = next(line for line in table.lines if line.pid == pid)  # type: ignore[union-attr]
                assert line is row and row.agent_device is not None
                assert row.agent_device.sample is sample.devices[0]
            return drawn

    drawn = asyncio.run(run())
    for sample in samples.values():
        assert any(short_bytes(sample.devices[0].allocated) in line for line in drawn), drawn
    # (The header's and the border's words are Texts, made once; a row's line is none.)
    rows = [t.plain for t in made if any(str(pid) in t.plain for pid in samples)]
    assert rows == []


def test_rank_and_job_are_the_agent_s_and_the_peers_are_written_as_the_device_is_made() -> None:
    store, observer, _, _ = _round()
    obs = observer.latest()
    agent = store.agent(101)
    assert agent is not None and agent.rank == 0 and agent.job is not None
    top = obs.diagnosis.devices[(101, 0)]
    assert (top.rank, top.job, top.peer_ranks, top.peers_median_peak_bytes) == (
        0,
        agent.job.label,
        1,
        20 * GiB,
    )
    # No second pass copies the devices to place or rank them.
    assert not hasattr(observation_module, "_placed")
    assert "rank_drift" in {s.rule for s in obs.suggestions}


def test_the_dashboard_copies_a_row_only_for_what_its_viewer_remembers() -> None:
    _, observer, _, _ = _round()
    obs = observer.latest()
    users: dict[int, str] = {}
    dash = view.build(obs, users=users)
    assert all(a is b for a, b in zip(dash.processes, obs.entries, strict=True))
    assert users == {101: "ann", 102: "ann"}
    # Another uid's viewer: the same rows, not its own.
    other = view.build(obs, my_uid=UID + 1)
    assert [r.own for r in other.processes] == [False, False]
    assert [r.own for r in dash.processes] == [True, True]


def test_what_the_store_keeps_across_rounds_is_written_into_the_next_round_s_poll() -> None:
    store, _, samples, first = _round()
    # A round that brought no sample (the agent hung) but a breakdown it had measured: the
    # store's record is that round's poll itself, holding what the store keeps across rounds
    # (the hello, the last sample's device record, memtop's peak, the step) and the breakdown.
    reply = AgentBreakdown(11.0, 6, False, {0: {"parameters": GiB}})
    hung = AgentView(101, AgentStatus.HUNG, error="hung since 10:00:00", breakdown_reply=reply)
    with store.round():
        store.update_agents([hung], when=11.0)
    kept = store.agent(101)
    assert kept is hung and kept.kept
    assert kept.hello is first[101].hello and kept.rank == 0
    assert kept.sample is None and kept.devices[0] is samples[101].devices[0]
    assert (kept.step, kept.last_sample_time, kept.sampled_peak(0)) == (5, 10.0, 20 * GiB)
    assert (kept.breakdown, kept.breakdown_time, kept.breakdown_step) == (
        {0: {"parameters": GiB}},
        11.0,
        6,
    )
    assert store.view().agents[0] is hung
    # The first round's record, which a reader of that round may still hold, is as it was.
    assert first[101].state == AgentStatus.CONNECTED and first[101].breakdown is None
    # A record a store kept is never written again: handed to another store (a recording's or
    # a scrape's record fed twice), the other store keeps a copy of it with its own figures.
    other = Store()
    other.update_agents([hung], when=12.0)
    copy = other.agent(101)
    assert copy is not None and copy is not hung and copy.kept
    assert copy.devices == () and copy.sampled_peaks == {} and copy.breakdown is not None
    assert hung.devices[0] is samples[101].devices[0] and hung.sampled_peak(0) == 20 * GiB


def test_every_field_marked_store_kept_is_carried_through_a_round_without_news() -> None:
    # The store's part of an agent's record is read from the record's own fields (those marked
    # STORE_KEPT), not from a list of names beside it: each marked field, whatever it holds, is
    # the next round's too when that round brings nothing for it (a hung agent's poll).
    store, _, _, _ = _round()
    marked = [f.name for f in dataclasses.fields(AgentView) if f.metadata.get("store_kept")]
    assert {"devices", "sampled_peaks", "host_memory", "action_counts", "sites"} <= set(marked)
    values = {name: object() for name in marked}
    # (the kept record with every marked figure set to something only this test holds)
    store._agents[101] = dataclasses.replace(store.agent(101), **values)  # type: ignore[arg-type]
    with store.round():
        store.update_agents([AgentView(101, AgentStatus.HUNG)], when=11.0)
    after = store.agent(101)
    assert after is not None
    assert [name for name in marked if getattr(after, name) is not values[name]] == []


@pytest.mark.slow
def test_a_real_agent_s_poll_is_the_record_the_row_is_drawn_from(tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    demo = Demo(gpus=1, scenario="healthy", step_time=0.05, socket_dir=tmp_path)
    demo.start()
    try:
        assert demo.wait_ready(30)
        pool = AgentPool(tmp_path)
        polls: list[AgentView] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            polls = pool.poll()
            if polls and all(p.sample is not None and p.sample.devices for p in polls):
                break
            time.sleep(0.1)
        assert polls and all(p.sample is not None for p in polls)
        store = Store()
        with store.round():
            store.update_agents(polls)
        obs = Observer(store, uid=os.getuid()).latest()
        for poll in polls:
            assert poll.sample is not None
            # The pool's record is the store's, the round's and the observation's agent.
            assert store.agent(poll.pid) is poll and obs.agent(poll.pid) is poll
            assert all(a is b for a, b in zip(poll.devices, poll.sample.devices, strict=True))
            row = next(r for r in obs.entries if r.pid == poll.pid)
            assert row.agent is poll and row.agent_device is not None
            assert row.agent_device.sample is poll.sample.devices[0]
        pool.close()
    finally:
        demo.stop()
