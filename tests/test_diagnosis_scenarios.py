"""The diagnosis against real simulated trainers: each scenario gets the verdict a user expects.

Real subprocesses with the real agent on real sockets; the sampler and the Diagnoser as the
dashboard and `memtop --once` use them.  Trainers step every 20 ms so a test takes seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from memtop.diagnosis import Diagnoser, Diagnosis
from memtop.engine.observation import Observer
from memtop.engine.sampler import Sampler
from memtop.engine.store import Store
from memtop.present import report
from memtop.sim.demo import Demo
from memtop.sources.agents import AgentPool
from memtop.sources.devices import DefaultDeviceSource

MiB = 1 << 20
pytestmark = pytest.mark.slow


class Watch:
    def __init__(self, directory: Path) -> None:
        self.store = Store()
        self.sampler = Sampler(
            self.store,
            DefaultDeviceSource(directory, simulated_only=True),
            AgentPool(directory),
            snapshot_interval=2.0,
        )
        self.observer = Observer(self.store, Diagnoser(leak_refresh_s=0.0))

    def until(self, seconds: float, done=lambda d: False, interval: float = 0.1) -> Diagnosis:
        deadline = time.monotonic() + seconds
        while True:
            self.sampler.sample_once()
            diagnosis = self.observer.latest().diagnosis
            if done(diagnosis) or time.monotonic() > deadline:
                return diagnosis
            time.sleep(interval)


@pytest.fixture
def trainer(socket_dir: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Demo, Watch]]:
    scenario, env = request.param
    demo = Demo(gpus=1, scenario=scenario, step_time=0.02, socket_dir=socket_dir, extra_env=env)
    demo.start()
    watch = Watch(socket_dir)
    try:
        assert demo.wait_ready(30)
        yield demo, watch
    finally:
        watch.sampler.stop()
        demo.stop()


def rules_of(diagnosis: Diagnosis) -> set[str]:
    return {s.rule for s in diagnosis.suggestions}


def only_device(diagnosis: Diagnosis):
    (device,) = diagnosis.devices.values()
    return device


@pytest.mark.parametrize("trainer", [("leak", {})], indirect=True)
def test_leak_scenario_is_found_at_its_true_rate(trainer):
    _demo, watch = trainer
    diagnosis = watch.until(30, lambda d: any(x.leak.detected for x in d.devices.values()))
    device = only_device(diagnosis)
    assert device.leak.detected, device.leak.reason
    true_rate = 8 * MiB + 512  # the retained 8 MiB tensor and the 512-byte loss, every step
    assert device.leak.bytes_per_step == pytest.approx(true_rate, rel=0.01)
    assert device.leak.steps_to_full is not None and device.leak.seconds_to_full is not None
    assert "leak" in rules_of(diagnosis)
    data = report.build(watch.observer.latest())
    (agent,) = data["agents"]
    leak = agent["devices"][0]["leak"]
    assert leak["detected"] is True and leak["bytes_per_step"] == pytest.approx(true_rate, 0.01)
    assert any(s["title"].startswith("Leak:") for s in data["suggestions"])


@pytest.mark.parametrize("trainer", [("healthy", {})], indirect=True)
def test_healthy_scenario_is_never_called_a_leak(trainer):
    _demo, watch = trainer
    seen = []
    watch.until(8, lambda d: seen.append(only_device(d).leak.detected) and False)
    assert len(seen) > 20 and not any(seen)
    device = only_device(watch.observer.latest().diagnosis)
    assert device.leak.basis == "steps" and device.leak.samples >= 100


@pytest.mark.parametrize("trainer", [("fragment", {})], indirect=True)
def test_fragment_scenario_suggests_expandable_segments(trainer):
    _demo, watch = trainer
    diagnosis = watch.until(15, lambda d: "expandable_segments" in rules_of(d))
    device = only_device(diagnosis)
    assert device.fragmentation.gauge_smoothed >= 0.2
    assert "expandable_segments" in rules_of(diagnosis)
    (fix,) = [s.fix for s in diagnosis.suggestions if s.rule == "expandable_segments"]
    assert fix == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    # The low-rate snapshot gives the largest request the cache can serve, and (from an agent
    # that sends summarize_segments' figures) the bytes stranded by splits.
    diagnosis = watch.until(
        5, lambda d: only_device(d).fragmentation.largest_free_block_bytes is not None
    )
    frag = only_device(diagnosis).fragmentation
    assert frag.largest_free_block_bytes is not None and frag.largest_free_block_bytes > 0
    if frag.external is not None:
        assert 0.0 <= frag.external <= 1.0


@pytest.mark.parametrize(
    "trainer",
    [("fragment", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})],
    indirect=True,
)
def test_fragment_scenario_with_expandable_segments_does_not_suggest_it(trainer):
    _demo, watch = trainer
    diagnosis = watch.until(6)
    device = only_device(diagnosis)
    assert device.allocator_conf == "expandable_segments:True"
    assert device.fragmentation.gauge_smoothed < 0.05
    assert "expandable_segments" not in rules_of(diagnosis)


@pytest.mark.parametrize("trainer", [("fragment", {})], indirect=True)
def test_fragment_scenario_tuned_live_stops_suggesting_expandable_segments(trainer, socket_dir):
    # `memtop tune` turned them on inside the running trainer: its environment still says
    # nothing, but the settings in force do, and a restart is no longer the advice (issue 34).
    from memtop.commands.actions import agent_action

    demo, watch = trainer
    diagnosis = watch.until(15, lambda d: "expandable_segments" in rules_of(d))
    assert "expandable_segments" in rules_of(diagnosis)
    (pid,) = [p.pid for p in demo.processes]
    result = agent_action(
        pid,
        "tune",
        {"set": {"expandable_segments": True}, "empty_cache": True, "wait_s": 5},
        socket_dir,
    )
    assert result["after"] == "expandable_segments:True"
    # Wholly free cached segments went back to the device at the same boundary.
    assert result["reserved_after"]["0"] < result["reserved_before"]["0"]
    diagnosis = watch.until(
        10, lambda d: only_device(d).allocator_conf == "expandable_segments:True"
    )
    assert only_device(diagnosis).allocator_conf == "expandable_segments:True"
    assert "expandable_segments" not in rules_of(diagnosis)
    data = report.build(watch.observer.latest())
    (agent,) = data["agents"]
    assert agent["allocator_conf"] == ""  # the environment's, as the trainer started
    assert agent["allocator_settings"] == "expandable_segments:True"
    assert any(
        "allocator settings: (default) → expandable_segments:True" in e
        for e in [text for _, text in watch.store.view().events]
    )


@pytest.mark.parametrize("trainer", [("pressure", {})], indirect=True)
def test_pressure_scenario_reaches_critical_usage_and_shows_retries(trainer):
    _demo, watch = trainer
    severities: set[str] = set()
    rules: set[str] = set()

    def seen_enough(diagnosis: Diagnosis) -> bool:
        severities.update(s.severity for s in diagnosis.suggestions if s.rule == "usage")
        rules.update(rules_of(diagnosis))
        urgent = severities & {"critical", "emergency"}
        return only_device(diagnosis).pressure.retries > 0 and bool(urgent)

    device = only_device(watch.until(40, seen_enough))
    assert device.pressure.retries > 0
    assert severities & {"critical", "emergency"}
    assert "expandable_segments" in rules  # retries, and no expandable segments


STEPS_FOR_A_VERDICT = 128


def test_once_json_carries_the_diagnosis(socket_dir: Path):
    demo = Demo(gpus=1, scenario="leak", step_time=0.02, socket_dir=socket_dir)
    demo.start()
    try:
        assert demo.wait_ready(30)
        # Enough steps for the detector (3 s is 150 steps at 20 ms on a quiet box; a loaded
        # one steps slower, and a verdict on 40 steps would rightly be "too few").
        deadline = time.monotonic() + 60
        while True:
            time.sleep(3)
            out = subprocess.run(
                [sys.executable, "-m", "memtop", "--once", "--json", "--socket-dir",
                 str(socket_dir)],
                capture_output=True, text=True, timeout=60,
                env=dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir)),
            )  # fmt: skip
            assert out.returncode == 0, out.stderr
            data = json.loads(out.stdout)
            (agent,) = data["agents"]
            device = agent["devices"][0]
            if device["step"] >= STEPS_FOR_A_VERDICT or time.monotonic() > deadline:
                break
    finally:
        demo.stop()
    assert set(device["leak"]) >= {
        "detected",
        "bytes_per_step",
        "bytes_per_second",
        "steps_to_full",
        "seconds_to_full",
        "confidence",
    }
    assert device["leak"]["detected"] is True, (device["step"], device["leak"])
    assert isinstance(device["fragmentation"], float)
    assert set(device["breakdown"]) >= {"parameters", "gradients", "optimizer_state", "other"}
    assert device["breakdown"]["optimizer_state"] == 2 * device["breakdown"]["parameters"]
    for suggestion in data["suggestions"]:
        assert set(suggestion) >= {"severity", "pid", "device", "title", "detail"}
        assert suggestion["severity"] in ("info", "warning", "critical", "emergency")
