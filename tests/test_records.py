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

from memtop.engine import observation as observation_module
from memtop.engine.observation import Observer, ProcessRow
from memtop.engine.store import Store
from memtop.model import (
    AgentDevice,
    AgentDeviceSample,
    AgentHello,
    AgentPoll,
    AgentSample,
    AgentStatus,
    AgentView,
    DeviceReading,
    DriverReading,
    GpuProcess,
    ProcessInfo,
)
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


def _round() -> tuple[Store, Observer, dict[int, AgentSample]]:
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
        store.update_agents(
            [
                AgentPoll(pid, AgentStatus.CONNECTED, _hello(pid, rank), samples[pid])
                for rank, pid in enumerate(samples)
            ],
            when=10.0,
        )
    return store, Observer(store, clock=lambda: 10.0, host="box", uid=UID), samples


def test_the_reply_s_record_is_held_by_reference_from_the_store_to_the_row() -> None:
    store, observer, samples = _round()
    obs = observer.latest()
    dash = view.build(obs)
    for pid, sample in samples.items():
        reply_record = sample.devices[0]
        # The store keeps one record per agent and per device, holding the parsed sample.
        kept = store.agent(pid)
        assert isinstance(kept, AgentView) and kept is store.agent(pid)  # no copy per reader
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


def test_rank_and_job_are_the_agent_s_and_the_peers_are_written_as_the_device_is_made() -> None:
    store, observer, _ = _round()
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
    _, observer, _ = _round()
    obs = observer.latest()
    users: dict[int, str] = {}
    dash = view.build(obs, users=users)
    assert all(a is b for a, b in zip(dash.processes, obs.entries, strict=True))
    assert users == {101: "ann", 102: "ann"}
    # Another uid's viewer: the same rows, not its own.
    other = view.build(obs, my_uid=UID + 1)
    assert [r.own for r in other.processes] == [False, False]
    assert [r.own for r in dash.processes] == [True, True]
