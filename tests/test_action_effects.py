"""Every action memtop performed, with its effect measured (issue 34, item 2): the window of
history before it against the window after, in the detail screen and `--once --json`."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from memtop.diagnosis.effects import effect, window
from memtop.model import ActionRecord
from memtop.present import report

MiB = 1 << 20


def test_noisy_steps_give_a_noise_that_covers_no_change() -> None:
    import random

    rng = random.Random(7)
    times = [float(t) for t in range(121)]
    flat = [1.0] * 121
    steps, stamps, now = [0.0], [0.0], 0.0
    for step in range(1, 6001):
        now += 0.020 * rng.uniform(0.8, 1.2)  # the same 20 ms step, ±20 %
        if step % 50 == 0:
            steps.append(float(step))
            stamps.append(now)
    at = stamps[len(stamps) // 2]
    found = effect(ActionRecord("cleanup", at, 1), 0, times, flat, flat, flat, steps, stamps)
    change = found.step_time_change()
    assert change is not None
    assert abs(change[0]) <= change[1], change  # no difference beyond noise


def test_the_windows_before_and_after_an_action() -> None:
    # One sample a second for two minutes; at t=60 the action: reserved falls from 4 to 3 GiB,
    # split bytes from 900 to 100 MiB, retries stop (14 a minute before), steps go from 20 to
    # 21 ms.
    times = [float(t) for t in range(121)]
    reserved = [4096.0 * MiB if t <= 60 else 3072.0 * MiB for t in range(121)]
    split = [900.0 * MiB if t <= 60 else 100.0 * MiB for t in range(121)]
    retries = [14.0 * min(t, 60) / 60 for t in range(121)]
    mark_steps = [float(s) for s in range(0, 6001, 50)]
    mark_times = [s * 0.020 if s <= 3000 else 60 + (s - 3000) * 0.021 for s in mark_steps]
    action = ActionRecord("tune", 60.0, 4242, {"set": {"expandable_segments": True}})
    found = effect(action, 0, times, reserved, split, retries, mark_steps, mark_times)
    assert found.before is not None and found.after is not None
    assert found.before.reserved_bytes == 4096 * MiB and found.after.reserved_bytes == 3072 * MiB
    assert found.before.split_bytes == 900 * MiB and found.after.split_bytes == 100 * MiB
    assert found.before.retries_per_min == pytest.approx(14.0, rel=0.05)
    assert found.after.retries_per_min == 0.0
    assert found.before.step_time_s == pytest.approx(0.020)
    assert found.after.step_time_s == pytest.approx(0.021)
    assert found.before.samples == 60 and found.after.samples == 60
    # +5 % with steps that never vary: beyond a noise of nothing.
    change = found.step_time_change()
    assert change is not None
    assert change[0] == pytest.approx(5.0) and change[1] == pytest.approx(0.0, abs=1e-6)
    said = found.as_json()
    assert said["kind"] == "tune" and said["pid"] == 4242 and said["device"] == 0
    assert said["args"] == {"set": {"expandable_segments": True}}
    # Nothing after it yet: said, not guessed.
    assert window(times, reserved, split, retries, [], [], 120.0, 180.0) is None


@pytest.mark.slow
def test_a_tune_in_a_live_trainer_is_measured_before_and_after(socket_dir: Path) -> None:
    from memtop.diagnosis import Diagnoser
    from memtop.engine.observation import Observer
    from memtop.engine.sampler import Sampler
    from memtop.engine.store import Store
    from memtop.sim.demo import Demo
    from memtop.sources.agents import AgentPool
    from memtop.sources.devices import DefaultDeviceSource
    from memtop.ui.view import build, build_detail, effect_lines

    demo = Demo(gpus=1, scenario="fragment", step_time=0.02, socket_dir=socket_dir)
    demo.start()
    store = Store()
    sampler = Sampler(
        store, DefaultDeviceSource(socket_dir, simulated_only=True), AgentPool(socket_dir)
    )
    observer = Observer(store, Diagnoser(leak_refresh_s=0.0))
    try:
        assert demo.wait_ready(30)
        (pid,) = [p.pid for p in demo.processes]

        def rounds(seconds: float) -> None:
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                sampler.sample_once()
                time.sleep(0.1)

        rounds(3)
        reply = sampler.act(
            pid, "tune", {"set": {"expandable_segments": True}, "empty_cache": True}
        ).result(timeout=20)
        assert reply.ok, reply.error
        rounds(3)
        obs = observer.latest()
    finally:
        sampler.stop()
        demo.stop()
    (agent,) = obs.agents
    (found,) = obs.effects_of(agent.pid)
    assert found.action.kind == "tune" and found.action.pid == pid and found.device == 0
    before, after = found.before, found.after
    assert before is not None and after is not None
    assert before.samples >= 5 and after.samples >= 5
    # The trainer steps every 20 ms (plus its simulated work): the median says so.
    for side in (before, after):
        assert side.step_time_s is not None and 0.015 < side.step_time_s < 0.2, side
        assert side.reserved_bytes is not None and side.reserved_bytes > 0
    assert before.split_bytes is not None and before.split_bytes > 0  # it fragments
    data = report.build(obs)
    (said,) = data["actions"]
    assert said["kind"] == "tune" and said["pid"] == pid
    assert said["args"] == {"set": {"expandable_segments": True}, "empty_cache": True}
    assert said["before"]["reserved_bytes"] == before.reserved_bytes
    assert said["after"]["step_time_s"] is not None
    # The step time's change comes with its noise; the same trainer steps no slower for it
    # beyond that noise by much (a loaded box: a wide bound, the point is that both are said).
    assert said["step_time_change_pct"] is not None and said["step_time_noise_pct"] > 0
    assert " %)" in effect_lines(found, obs.time)[-1] and "±" in effect_lines(found, obs.time)[-1]
    # The detail screen says it in one line.
    dashboard = build(obs)
    row = next(r for r in dashboard.processes if r.pid == pid)
    detail = build_detail(obs, row, None)
    lines = effect_lines(found, obs.time)
    assert detail.actions == lines
    assert lines[0].startswith("tune ") and " ago: rsvd " in lines[0] and " split " in lines[0]
    assert "→" in lines[0] and lines[1].startswith("retries ") and " · step " in lines[1]
    assert max(len(line) for line in lines) <= 46, lines  # the allocator box at 100 columns
