"""One read per round (issue 22.1): the sampler publishes a round once, at its end, and an
observation is built from one immutable view of one generation, taken with one lock.

The real `Sampler` runs on its own thread against fake sources whose every figure says which
round it belongs to (round n: the driver's version is "n", the GPU uses n MiB, the agent is at
step n with n MiB allocated and a step mark at n).  An observation that mixes two rounds (the
driver's reading of one and the agent's sample of the next, or a sample beside a history or a
diagnosis of another) is a torn round.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from memtop.engine.observation import Observation, Observer
from memtop.engine.sampler import Sampler
from memtop.engine.store import Store
from memtop.model import (
    AgentDevice,
    AgentDeviceSample,
    AgentHello,
    AgentSample,
    DeviceReading,
    DriverReading,
    GpuProcess,
    StepMark,
)
from memtop.sources.agents import CONNECTED, AgentView

MiB = 1 << 20
TOTAL = 80 * 1024 * MiB
PID = os.getpid()  # a real process: the sampler looks its owner up
UUID = "GPU-round"


class RoundCounter:
    """Each device read opens a new round; the agents answer in the round that is open."""

    def __init__(self) -> None:
        self.round = 0


class RoundDevices:
    def __init__(self, counter: RoundCounter) -> None:
        self.counter = counter

    def read(self) -> DriverReading:
        self.counter.round += 1
        n = self.counter.round
        device = DeviceReading(
            0, UUID, "Round GPU", TOTAL, n * MiB, TOTAL - n * MiB,
            processes=(GpuProcess(PID, n * MiB),),
        )  # fmt: skip
        return DriverReading(available=True, devices=(device,), driver_version=str(n))

    def close(self) -> None:
        pass


class RoundAgents:
    """Stands in for AgentPool: one agent whose every figure is the open round's number."""

    timeout = 1.0

    def __init__(self, counter: RoundCounter) -> None:
        self.counter = counter
        self.low_rate: dict[str, float] = {}
        self.problems: list[str] = []
        self.hello = AgentHello(
            1, PID, ("train.py",), "3.11", "2.13", "", (AgentDevice(0, UUID, "Round GPU", TOTAL),)
        )

    def poll(self, known: Any, budget: float = 1.0) -> list[AgentView]:
        n = self.counter.round
        stats = {
            "allocated_bytes.all.current": n * MiB,
            "reserved_bytes.all.current": 2 * n * MiB,
            "allocated_bytes.all.peak": 3 * n * MiB,
        }
        now = time.time()
        sample = AgentSample(
            time=now,
            step=n,
            devices=(AgentDeviceSample(0, stats, TOTAL - 2 * n * MiB, TOTAL),),
            step_marks=(StepMark(n, now, {0: n * MiB}),),
        )
        return [AgentView(PID, CONNECTED, self.hello, sample)]

    def close(self) -> None:
        pass


@pytest.fixture
def sampler() -> Iterator[Sampler]:
    counter = RoundCounter()
    sampler = Sampler(Store(), RoundDevices(counter), RoundAgents(counter), interval=0.0)  # type: ignore[arg-type]
    try:
        yield sampler
    finally:
        sampler.stop()


def rounds_in(obs: Observation) -> set[int]:
    """Every round number the observation's parts say they belong to."""
    assert obs.driver_version is not None
    seen = {int(obs.driver_version)}
    (gpu,) = obs.gpus
    assert gpu.used_bytes is not None
    seen.add(gpu.used_bytes // MiB)
    seen.add(int(gpu.used_history[1][-1]) // MiB)
    agent = obs.agent(PID)
    assert agent is not None and agent.step is not None
    seen.add(agent.step)
    (dev,) = obs.devices_of(agent)
    seen.add(dev.allocated_bytes // MiB)
    assert dev.nvml_used_bytes is not None
    seen.add(dev.nvml_used_bytes // MiB)
    seen.add(int(dev.history.allocated[-1]) // MiB)
    seen.add(int(dev.history.mark_step[-1]))
    diagnosed = obs.diagnosis.device(PID, 0)
    assert diagnosed is not None and diagnosed.baseline_bytes is not None
    seen.add(diagnosed.allocated_bytes // MiB)
    seen.add(diagnosed.baseline_bytes // MiB)
    return seen


def test_observations_built_while_the_sampler_writes_never_see_a_torn_round(
    sampler: Sampler,
) -> None:
    observer = Observer(sampler.store)
    sampler.sample_once()  # the first round, so that every part exists
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # hand the GIL over often: a torn round shows within seconds
    torn: list[tuple[int, set[int]]] = []
    built = 0
    try:
        sampler.start()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and len(torn) < 3:
            obs = observer.latest()
            built += 1
            seen = rounds_in(obs)
            if len(seen) != 1:
                torn.append((obs.generation, seen))
    finally:
        sys.setswitchinterval(switch)
        sampler.stop()
    assert not torn, f"observations mixing rounds (generation, rounds seen): {torn}"
    assert sampler.rounds > 20 and built > 20  # both sides did run


def test_a_round_is_one_generation(sampler: Sampler) -> None:
    store = sampler.store
    for _ in range(3):
        before = store.generation
        sampler.sample_once()
        assert store.generation == before + 1


class CountingLock:
    """The store's lock, counting how often it is taken."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self.takes = 0

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        self.takes += 1
        return bool(self.lock.acquire(*args, **kwargs))

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def test_one_observation_takes_the_store_lock_once(sampler: Sampler) -> None:
    store = sampler.store
    for _ in range(3):
        sampler.sample_once()
    observer = Observer(store)
    counting = CountingLock(store._lock)
    store._lock = counting  # type: ignore[assignment]
    obs = observer.latest()
    assert obs.generation == store.generation
    assert obs.device(PID, 0) is not None and obs.gpus[0].agents
    assert counting.takes == 1
    observer.latest()  # the same generation: nothing read again
    assert counting.takes == 1


def test_a_replay_seek_is_one_generation() -> None:
    """A replay's seek applies many events (and a seek back starts the store over): a screen
    refreshing meanwhile sees the moment before it or after it, one generation apart."""
    from pathlib import Path

    from memtop.engine.playback import Player
    from memtop.sources.replay import load

    recording = load(Path(__file__).parent / "data" / "traces" / "leak.jsonl.gz")
    store = Store()
    player = Player(store, recording)
    for offset in (30.0, 150.0, 60.0):  # on, on, and back (the store starts over)
        before = store.generation
        player.seek_offset(offset)
        assert store.generation == before + 1
    (agent,) = Observer(store, clock=player.clock).latest().agents
    assert agent.step is not None and agent.devices
