"""The observation: the one join of devices, processes and agents, diagnosed once per store
generation; and the one peak every consumer shows."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.observations import frozen_observation, frozen_observer
from ui_frozen import MY_UID, TRAINERS, UUIDS

from memtop.figures.units import format_bytes
from memtop.model import AgentStatus
from memtop.present import report
from memtop.ui import view


def test_agents_join_their_gpus_by_uuid_and_processes_by_pid_and_uuid():
    obs = frozen_observation()
    assert [g.uuid for g in obs.gpus] == list(UUIDS)
    for gpu in obs.gpus:
        assert all(d.uuid == gpu.uuid and d.gpu == gpu.index for d in gpu.agents)
    assert {d.pid for d in obs.gpus[0].agents} == {t.pid for t in TRAINERS if t.gpu == 0}
    # The process table: every agent device with what the driver charges it, then the driver's
    # processes without an agent.
    entries = {(e.pid, e.gpu): e for e in obs.entries}
    for trainer in TRAINERS:
        entry = entries[(trainer.pid, trainer.gpu)]
        assert entry.agent_device is not None and entry.agent is not None
        assert entry.used_bytes is not None
        assert entry.used_bytes == entry.agent_device.nvml_used_bytes
        assert (
            entry.agent_device.non_pytorch_bytes
            == entry.used_bytes - entry.agent_device.reserved_bytes
        )
    strangers = [e for e in obs.entries if e.agent is None]
    assert {e.pid for e in strangers} == {7001, 7002}
    assert all(e.info is not None for e in strangers)
    assert obs.uid == MY_UID and obs.host == "gpu-box"


def test_the_observation_is_immutable():
    obs = frozen_observation()
    with pytest.raises(dataclasses.FrozenInstanceError):
        obs.gpus = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        obs.gpus[0].agents[0].sampled_peak_bytes = 0  # type: ignore[misc]


def test_built_at_most_once_per_store_generation():
    observer = frozen_observer()
    first = observer.latest()
    assert observer.latest() is first and observer.builds == 1
    observer.store.note("something happened")
    second = observer.latest()
    assert second is not first and second.generation > first.generation
    assert observer.builds == 2 and second.events[-1] == "something happened"
    assert observer.publish() is not second and observer.builds == 3


def test_peak_is_torchs_peak_everywhere():
    obs = frozen_observation()
    data = report.build(obs)
    dash = view.build(obs)
    text = report.render_text(data)
    for agent in data["agents"]:
        for dev in agent["devices"]:
            stats = obs.device(agent["pid"], dev["index"]).sample.stats  # type: ignore[union-attr]
            assert dev["peak_bytes"] == dev["torch_peak_bytes"] == stats["allocated_bytes.all.peak"]
            assert dev["sampled_peak_bytes"] <= dev["peak_bytes"]
            (row,) = [r for r in dash.processes if r.pid == agent["pid"]]
            assert row.peak == dev["peak_bytes"]  # the dashboard's number ...
            assert format_bytes(dev["peak_bytes"]) in text  # ... and the text report's
    for gpu, row, device in zip(obs.gpus, dash.gpus, data["devices"], strict=True):
        assert row.peak == gpu.peak_sum_bytes == sum(a.peak_bytes for a in gpu.agents)
        assert device["peak_sum_bytes"] == row.peak
    assert obs.diagnosis.devices  # suggestions judge the same peak
    for (pid, index), diagnosed in obs.diagnosis.devices.items():
        assert diagnosed.peak_bytes == obs.device(pid, index).peak_bytes  # type: ignore[union-attr]


def test_an_exited_agent_stays_in_view_but_leaves_its_gpu():
    obs = frozen_observation(exited=4102)
    agent = obs.agent(4102)
    assert agent is not None and agent.status == AgentStatus.EXITED and not agent.live
    assert all(d.pid != 4102 for g in obs.gpus for d in g.agents)
    assert any(e.pid == 4102 for e in obs.entries)
