"""Thread discipline (DESIGN §6): whatever touches tensors or CUDA runs on the trainer's thread,
between two steps, never while a CUDA graph is captured; the agent thread serves what was
measured there.  Checked with a probe that records the thread of every call."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from stepping import Stepper

from memtop import protocol
from memtop.agent.probe import Breakdown, ProbeDevice
from memtop.agent.server import Agent
from memtop.sim.allocator import SimulatedCachingAllocator
from memtop.sim.device import LocalDeviceMemory
from memtop.sim.probe import SimulatedGpu, SimulatedProbe
from memtop.sources.agents import AgentClient, AgentError

MiB = 1 << 20
GiB = 1 << 30
TRAINER_ONLY = ("mem_get_info", "empty_cache", "snapshot", "breakdown", "is_capturing")


class RecordingProbe(SimulatedProbe):
    """A simulated probe that remembers, for every trainer-only call, the thread it came from
    and whether the trainer was mid-step at that moment."""

    def __init__(self, gpus: list[SimulatedGpu]) -> None:
        super().__init__(gpus, breakdown=self._parts)
        self.stepper: Stepper | None = None
        self.calls: list[tuple[str, int, bool]] = []
        self.capturing = False
        self.device_reads: list[int] = []  # the thread of every devices() call (a driver query)

    def _record(self, name: str) -> None:
        stepper = self.stepper
        self.calls.append(
            (name, threading.get_ident(), bool(stepper is not None and stepper.in_step))
        )

    def _parts(self) -> dict[int, Breakdown]:
        return {0: Breakdown(parameters=4 * MiB, gradients=4 * MiB, optimizer_state=8 * MiB,
                             allocated=self.memory_allocated(0))}  # fmt: skip

    def devices(self) -> list[ProbeDevice]:
        self.device_reads.append(threading.get_ident())
        return super().devices()

    def is_capturing(self) -> bool:
        self._record("is_capturing")
        return self.capturing

    def mem_get_info(self, index: int) -> tuple[int, int]:
        self._record("mem_get_info")
        return super().mem_get_info(index)

    def empty_cache(self, index: int) -> None:
        self._record("empty_cache")
        super().empty_cache(index)

    def snapshot(self) -> dict[str, Any]:
        self._record("snapshot")
        return super().snapshot()

    def breakdown(self) -> dict[int, Breakdown]:
        self._record("breakdown")
        return super().breakdown()


@pytest.fixture
def probe() -> RecordingProbe:
    allocator = SimulatedCachingAllocator(LocalDeviceMemory(8 * GiB), 0)
    device = ProbeDevice(0, "GPU-00000000-0000-0000-0000-0000000000d1", "Sim GPU", 8 * GiB)
    return RecordingProbe([SimulatedGpu(device, allocator)])


@pytest.fixture
def agent(socket_dir: Path, probe: RecordingProbe) -> Iterator[Agent]:
    server = Agent(probe, socket_dir)
    server.start()
    yield server
    server.stop()


def _client(agent: Agent) -> AgentClient:
    client = AgentClient(agent.pid, agent.directory, timeout=10.0)
    client.connect()
    return client


def test_every_trainer_only_call_runs_on_the_trainers_thread_between_steps(
    agent: Agent, probe: RecordingProbe, tmp_path: Path
):
    allocator = probe._allocator(0)
    blocks: list[int] = []

    def step_work(step: int) -> None:  # the trainer allocates and frees mid-step
        blocks.append(allocator.malloc((step % 7 + 1) * MiB))
        if len(blocks) > 4:
            allocator.free(blocks.pop(0))

    with Stepper(agent, period=0.005, work=step_work) as trainer:
        probe.stepper = trainer
        replies: dict[str, int] = {}
        with _client(agent) as client:
            deadline = time.monotonic() + 3.0
            turn = 0
            while time.monotonic() < deadline:
                cmd = ("sample", "breakdown", "snapshot", "cleanup", "reset_peak")[turn % 5]
                args: dict[str, Any] = {"wait_s": 2.0}
                if cmd == "snapshot":
                    args = {"path": str(tmp_path / f"s{turn}.pickle")}
                try:
                    client.request(cmd, args, timeout=10)
                    replies[f"{cmd}:ok"] = replies.get(f"{cmd}:ok", 0) + 1
                except AgentError as exc:
                    replies[f"{cmd}:{exc.code}"] = replies.get(f"{cmd}:{exc.code}", 0) + 1
                turn += 1
                time.sleep(0.02)
        ident = trainer.ident
    names = {name for name, _, _ in probe.calls}
    # Every kind of trainer-only work really happened ...
    assert {"mem_get_info", "empty_cache", "snapshot", "breakdown"} <= names, replies
    assert replies.get("cleanup:ok") and replies.get("snapshot:ok") and replies.get("sample:ok")
    # ... and all of it on the trainer's thread, at a step boundary.
    wrong = [(n, t, mid) for n, t, mid in probe.calls if t != ident or mid]
    assert not wrong, wrong[:5]
    assert not agent.errors


def test_cleanup_reply_names_the_thread_and_the_step_it_ran_after(
    agent: Agent, probe: RecordingProbe
):
    with Stepper(agent, period=0.01) as trainer, _client(agent) as client:
        probe.stepper = trainer
        result = client.request("cleanup", timeout=10)
        ident = trainer.ident
    assert result["thread_ident"] == ident and result["at_step_boundary"] is True
    [(_, thread, mid_step)] = [c for c in probe.calls if c[0] == "empty_cache"]
    assert thread == ident and not mid_step
    assert result["after_step"] >= 1


def test_nothing_runs_while_a_cuda_graph_is_captured(agent: Agent, probe: RecordingProbe):
    probe.capturing = True
    with Stepper(agent, period=0.01) as trainer, _client(agent) as client:
        probe.stepper = trainer
        asked = threading.Thread(
            target=lambda: results.append(client.request("cleanup", {"wait_s": 5}, timeout=10))
        )
        results: list[dict[str, Any]] = []
        asked.start()
        time.sleep(0.5)
        assert agent.boundary.deferred_while_capturing > 0
        assert not [c for c in probe.calls if c[0] != "is_capturing"]
        probe.capturing = False  # the capture ends: the cleanup runs at the next boundary
        asked.join(10)
    assert results and results[0]["at_step_boundary"] is True
    assert [c[0] for c in probe.calls if c[0] != "is_capturing"] == ["empty_cache"]


def test_without_steps_only_host_side_counters_are_read(agent: Agent, probe: RecordingProbe):
    with _client(agent) as client:
        sample = client.sample()
        for cmd in ("breakdown", "cleanup"):
            with pytest.raises(AgentError) as info:
                client.request(cmd)
            assert info.value.code == protocol.E_UNAVAILABLE
            assert "trainer's thread" in info.value.message
        summary = client.request("snapshot")
    assert summary["pending"] is True and summary["devices"] == {}
    # free bytes were not measured (mem_get_info is a CUDA call): an upper bound, said so
    device = client.hello.devices[0] if client.hello else None
    assert device is not None and sample.devices[0].free_bytes <= device.total_bytes
    assert probe.calls == []


def test_breakdown_is_measured_after_a_step_and_served_between(agent: Agent, probe: RecordingProbe):
    with Stepper(agent, period=0.01) as trainer, _client(agent) as client:
        probe.stepper = trainer
        first = client.request("breakdown", {"wait_s": 5})
        again = client.request("breakdown")
    assert first["measured"] == "after_step" and first["step"] >= 1
    parts = first["devices"]["0"]
    assert parts["gradients"] == 4 * MiB and parts["parameters"] == 4 * MiB
    total = parts["parameters"] + parts["gradients"] + parts["optimizer_state"] + parts["other"]
    assert total == parts["allocated"] or parts["other"] == 0
    assert again["time"] == first["time"]  # served from what was measured, not walked again
    assert [c[0] for c in probe.calls].count("breakdown") == 1


def test_step_count_is_exact_and_marks_are_rate_limited_at_any_step_rate(agent: Agent):
    started = time.monotonic()
    for _ in range(20000):
        agent.on_step(explicit=True)
    elapsed = time.monotonic() - started
    assert agent.step == 20000
    marks = len(agent.boundary.marks)
    assert 1 <= marks <= elapsed / agent.boundary.mark_interval_s + 2
    # The hook's own cost, measured where it is spent, stays small per step.
    costs = agent.boundary.costs()
    assert costs["hook_calls"] == 20000
    assert costs["hook_ns"] / costs["hook_calls"] < 50_000  # generous: a loaded 2-core CI box


def test_once_the_trainer_steps_the_agent_thread_asks_the_driver_nothing(
    agent: Agent, probe: RecordingProbe
):
    with Stepper(agent, period=0.01) as trainer:
        deadline = time.monotonic() + 5
        while not agent.boundary.devices_known and time.monotonic() < deadline:
            time.sleep(0.01)
        assert agent.boundary.devices_known
        probe.device_reads.clear()
        with _client(agent) as client:  # hello on connect
            for _ in range(5):  # 1.5 s: the list is refreshed (each second of steps) meanwhile
                assert client.sample().devices
                client.request("reset_peak", timeout=10)
                time.sleep(0.3)
        ident = trainer.ident
    # Which devices the trainer uses was read on its own thread, at step boundaries only.
    assert probe.device_reads and set(probe.device_reads) == {ident}
