"""The leak detector on synthetic per-step series and sampled sawtooths (DESIGN §5)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from memtop.diagnosis.leak import (
    MIN_MARKS,
    detect,
    detect_from_history,
    detect_from_steps,
    floor_values,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
T0 = 1_700_000_000.0


def series(
    n: int = 400,
    rate: float = 0.0,
    noise: float = 0.0,
    seed: int = 0,
    step_time: float = 0.1,
    base: float = 10 * GiB,
    extra=lambda step: 0.0,
    keep: float = 1.0,
) -> tuple[list[float], list[float], list[float]]:
    rng = random.Random(seed)
    steps, times, values = [], [], []
    t = T0
    for step in range(n):
        t += step_time * rng.uniform(0.7, 1.3)
        value = base + rate * step + extra(step) + (rng.gauss(0, noise) if noise else 0.0)
        if rng.random() <= keep:
            steps.append(float(step))
            times.append(t)
            values.append(float(int(value) // 512 * 512))
    return steps, times, values


def test_a_steady_leak_is_found_with_its_rate_and_time_to_full():
    steps, times, values = series(rate=8 * MiB + 512, step_time=0.1)
    estimate = detect_from_steps(steps, times, values, headroom_bytes=8 * GiB)
    assert estimate.detected and estimate.basis == "steps"
    assert estimate.bytes_per_step == pytest.approx(8 * MiB + 512, rel=0.01)
    assert estimate.bytes_per_second == pytest.approx((8 * MiB + 512) * 10, rel=0.1)
    assert estimate.steps_to_full == pytest.approx(1024, abs=2)  # 8 GiB / 8 MiB
    assert estimate.seconds_to_full == pytest.approx(102.4, rel=0.1)
    assert estimate.confidence > 0.999
    as_json = estimate.as_dict()
    assert set(as_json) >= {
        "detected",
        "bytes_per_step",
        "bytes_per_second",
        "steps_to_full",
        "seconds_to_full",
        "confidence",
    }
    assert isinstance(as_json["bytes_per_step"], int)


def test_a_noiseless_leak_with_one_step_off_the_line_is_a_leak_at_every_step():
    # The demo's leak pins 8.00 MiB a step to the byte, but now and then one step's baseline
    # sits 0.8 MiB off the line (a block rounded differently).  That one bin once passed as a
    # regime change, and the leak went unsaid for the 30 steps after it.
    off = {113: 0.8 * MiB, 190: -0.53 * MiB}
    steps, times, values = series(n=260, rate=8 * MiB, extra=lambda step: off.get(step, 0.0))
    for n in range(MIN_MARKS, len(steps) + 1):
        estimate = detect_from_steps(steps[:n], times[:n], values[:n], headroom_bytes=None)
        assert estimate.detected, (n, estimate.reason)
        assert estimate.bytes_per_step == pytest.approx(8 * MiB, rel=0.01)


def test_a_slow_leak_buried_in_noise_twenty_times_its_rate_is_found():
    rate = 256 * KiB
    steps, times, values = series(n=800, rate=rate, noise=20 * rate, seed=3)
    estimate = detect_from_steps(steps, times, values, 4 * GiB)
    assert estimate.detected
    assert estimate.bytes_per_step == pytest.approx(rate, rel=0.3)


@pytest.mark.parametrize("noise", [0.0, 4 * MiB, 64 * MiB])
def test_a_flat_baseline_is_not_a_leak(noise: float):
    for seed in range(5):
        steps, times, values = series(noise=noise, seed=seed)
        estimate = detect_from_steps(steps, times, values, 4 * GiB)
        assert not estimate.detected, (seed, estimate.reason)
        assert estimate.steps_to_full is None and estimate.seconds_to_full is None


def test_a_warm_up_ramp_that_plateaus_is_not_a_leak():
    ramp = lambda step: 2 * GiB * min(1.0, step / 100)  # noqa: E731
    steps, times, values = series(n=400, noise=1 * MiB, extra=ramp)
    estimate = detect_from_steps(steps, times, values, 4 * GiB)
    assert not estimate.detected, estimate.reason


def test_a_one_off_jump_is_not_a_leak_but_a_leak_after_it_is():
    jump = lambda step: 1 * GiB if step >= 150 else 0.0  # noqa: E731
    steps, times, values = series(n=400, noise=2 * MiB, extra=jump)
    flat = detect_from_steps(steps, times, values, 4 * GiB)
    assert not flat.detected, flat.reason
    steps, times, values = series(n=400, rate=1 * MiB, noise=2 * MiB, extra=jump)
    leaking = detect_from_steps(steps, times, values, 4 * GiB)
    assert leaking.detected
    assert leaking.bytes_per_step == pytest.approx(1 * MiB, rel=0.15)
    assert leaking.since is not None and leaking.since >= 140  # analysed after the jump


def test_a_jump_that_just_happened_is_not_called_a_leak():
    jump = lambda step: 1 * GiB if step >= 390 else 0.0  # noqa: E731
    steps, times, values = series(n=400, noise=2 * MiB, extra=jump)
    assert not detect_from_steps(steps, times, values, 4 * GiB).detected


def test_an_oom_restart_drops_the_level_and_the_leak_is_found_again_after_it():
    # A leaking trainer that OOMed and restarted from a checkpoint: a sawtooth of leaks.
    restart = lambda step: -300 * 4 * MiB if step >= 300 else 0.0  # noqa: E731
    steps, times, values = series(n=400, rate=4 * MiB, extra=restart)
    estimate = detect_from_steps(steps, times, values, 4 * GiB)
    assert estimate.detected
    assert estimate.bytes_per_step == pytest.approx(4 * MiB, rel=0.05)


def test_spikes_from_a_bigger_batch_now_and_then_are_not_a_leak():
    spikes = {50, 51, 200, 333, 390}
    spike = lambda step: 3 * GiB if step in spikes else 0.0  # noqa: E731
    steps, times, values = series(n=400, noise=1 * MiB, extra=spike)
    assert not detect_from_steps(steps, times, values, 4 * GiB).detected


def test_missing_marks_and_jittered_steps_do_not_bias_the_rate():
    steps, times, values = series(n=600, rate=2 * MiB, noise=4 * MiB, keep=0.7, seed=9)
    estimate = detect_from_steps(steps, times, values, 4 * GiB)
    assert estimate.detected
    assert estimate.bytes_per_step == pytest.approx(2 * MiB, rel=0.1)


def test_tiny_growth_is_not_flagged_before_it_amounts_to_a_mebibyte():
    steps, times, values = series(n=400, rate=512)  # one 512-byte tensor a step
    estimate = detect_from_steps(steps, times, values, 4 * GiB)
    assert not estimate.detected
    assert "KiB" in estimate.reason


# Per seed: the simulated allocator and workload, and the baselines of the steps run so far.
# Two tests take seed 20 (100 and 120 steps): its trainer is run once (~6 ms a step).
_FRAGMENT_RUNS: dict[int, tuple[object, object, list[float]]] = {}


def _fragment_baselines(seed: int, steps: int) -> list[float]:
    """Allocated bytes after each step of the fragment demo's trainer (the simulated allocator,
    run here): its per-layer outputs live 8 steps, so the baseline is a moving sum of 8 steps'
    random buffers (std 6 MiB, lag-1 autocorrelation 0.85), flat on average."""
    from memtop.sim.allocator import SimulatedCachingAllocator
    from memtop.sim.device import LocalDeviceMemory
    from memtop.sim.scenarios import Workload, model_for

    if seed not in _FRAGMENT_RUNS:
        allocator = SimulatedCachingAllocator(LocalDeviceMemory(80 * GiB), 0)
        workload = Workload("fragment", allocator, model_for("fragment", 80 * GiB), seed, pace=None)
        _FRAGMENT_RUNS[seed] = (allocator, workload, [])
    allocator, workload, out = _FRAGMENT_RUNS[seed]
    while len(out) < steps:
        workload.step()  # type: ignore[attr-defined]
        out.append(float(allocator.memory_allocated()))  # type: ignore[attr-defined]
    return out[:steps]


# Seeds whose baselines the plain trend test (before the correction) called a leak at some
# round: 28 and 54 with the simulator whose gradients live through the step boundary.
@pytest.mark.slow
@pytest.mark.parametrize(("seed", "steps"), [(28, 100), (54, 100)])
def test_a_baseline_that_wanders_for_a_few_steps_marked_at_every_step_is_not_a_leak(seed, steps):
    # A busy box slows the steps until every one is marked (the 20-a-second limit no longer
    # thins them); the fragment demo then showed a leak that came and went (issue 21). Marked
    # at every step these two trainers passed Mann–Kendall's z 3.09 without the correction for
    # the baseline's own autocorrelation.
    values = _fragment_baselines(seed, steps)
    marks = [float(step) for step in range(1, steps + 1)]
    times = [T0 + 0.05 * step for step in marks]
    for upto in range(MIN_MARKS, steps + 1, 2):  # as a dashboard judges it, round by round
        estimate = detect(marks[:upto], times[:upto], values[:upto], [], [], 40 * GiB)
        assert not estimate.detected, (upto, estimate)


# Seeds the trend test, with the lag-1 correction, still called a leak within 100 steps (first
# alarm at mark 37, 49, 68 and 99): 18 of seeds 1-99 did (bench/leak_eval.py --scenarios); and
# seed 33, 15 MiB up over its first 120 steps, which passed a persistence test at z 3.09.
@pytest.mark.parametrize(("seed", "steps"), [(20, 100), (88, 100), (22, 100), (37, 100), (33, 200)])
def test_a_wander_as_long_as_a_third_of_the_window_is_not_a_leak(seed, steps):
    # Thirty to ninety marks hold only a few of the fragment baseline's 8-step wanders: one
    # that rose for a third of the window passed Mann–Kendall, and its detrended marks looked
    # independent, so the lag-1 correction did not widen the test.
    values = _fragment_baselines(seed, steps)
    marks = [float(step) for step in range(1, steps + 1)]
    times = [T0 + 0.05 * step for step in marks]
    for upto in range(MIN_MARKS, steps + 1):  # every round, as a dashboard judges it
        estimate = detect(marks[:upto], times[:upto], values[:upto], [], [], 40 * GiB)
        assert not estimate.detected, (upto, estimate)


def test_a_leak_no_faster_than_the_fragment_baselines_wander_is_still_found():
    # 1 MiB a step under a wander of σ 7 MiB: not a clean climb, so it must persist over
    # 8-step medians first; it does well within 120 steps, at its true rate.
    values = [v + 1 * MiB * i for i, v in enumerate(_fragment_baselines(20, 120))]
    marks = [float(step) for step in range(1, 121)]
    times = [T0 + 0.05 * step for step in marks]
    estimate = detect(marks, times, values, [], [], 40 * GiB)
    assert estimate.detected, estimate
    assert estimate.bytes_per_step == pytest.approx(1 * MiB, rel=0.3)


def test_too_few_steps_say_so():
    steps, times, values = series(n=MIN_MARKS - 1, rate=64 * MiB)
    estimate = detect(steps, times, values, [], [], 4 * GiB)
    assert not estimate.detected and estimate.basis == "none"
    assert f"of {MIN_MARKS} steps" in estimate.reason


def sampled_sawtooth(
    seconds: float, leak_per_second: float, activations: float = 4 * GiB, step_time: float = 0.7
) -> tuple[list[float], list[float]]:
    """allocated sampled at ~1 Hz from a trainer whose steps memtop does not see."""
    rng = random.Random(1)
    times, values = [], []
    t = T0
    while t - T0 < seconds:
        t += rng.uniform(0.9, 1.1)
        phase = ((t - T0) / step_time) % 1.0
        times.append(t)
        values.append(10 * GiB + leak_per_second * (t - T0) + activations * phase)
    return times, values


def test_without_steps_the_rolling_minimum_finds_a_leak_under_a_sawtooth():
    times, values = sampled_sawtooth(600, leak_per_second=16 * MiB)
    estimate = detect([], [], [], times, values, 8 * GiB)
    assert estimate.detected and estimate.basis == "time"
    assert estimate.bytes_per_step is None
    assert estimate.bytes_per_second == pytest.approx(16 * MiB, rel=0.2)
    assert estimate.seconds_to_full == pytest.approx(8 * GiB / (16 * MiB), rel=0.2)


def test_without_steps_a_healthy_sawtooth_is_not_a_leak():
    times, values = sampled_sawtooth(900, leak_per_second=0.0)
    estimate = detect_from_history(times, values, 8 * GiB)
    assert not estimate.detected, estimate.reason


def test_without_steps_a_minute_of_history_is_needed():
    times, values = sampled_sawtooth(30, leak_per_second=64 * MiB)
    estimate = detect([], [], [], times, values, 8 * GiB)
    assert not estimate.detected and estimate.basis == "none"
    assert "s of history" in estimate.reason


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_the_evaluation_harness_runs_and_reports_its_figures():
    # Five series a label, not ten: eight with steps, two without and one server-shaped, each
    # kind the evaluation draws, judged with and without floor readings (seed 3: every leak
    # found, no false alarm, at five as at ten).  This test is the harness's run and report;
    # the detector's rates are measured on bench/leak_eval.py's own 400.  ~5.5 CPU-s of ~11.
    bench = Path(__file__).resolve().parent.parent / "bench" / "leak_eval.py"
    out = subprocess.run(
        [sys.executable, str(bench), "--series", "5", "--seed", "3", "--holdout", "4", "--wrong"],
        capture_output=True,
        text=True,
        timeout=300,  # the holdout seed judges its series without steps too
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result) >= {"detection_rate", "false_alarm_rate", "median_steps_to_detect"}
    assert result["detection_rate"] >= 0.75 and result["false_alarm_rate"] <= 0.25
    # The series without steps again on a seed not tuned on, beside the others.
    assert set(result["holdout"]["4"]) == {
        "without_steps",
        "server_shaped",
        # ... and judged again with the agent's floor readings (issue 31.3).
        "without_steps_floor_readings",
        "server_shaped_floor_readings",
    }
    with_floor = result["holdout"]["4"]["without_steps_floor_readings"]
    assert 0 <= with_floor["detection_rate"] <= 1 and 0 <= with_floor["false_alarm_rate"] <= 1
    assert "with floor readings" in out.stdout
    assert "seed 4 (held out" in out.stdout
    # What the floor can tell: the leaks without steps beyond any test of it, and the missed
    # ones' rises in floor resolutions (issue 31.3).
    without_steps = result["holdout"]["4"]["without_steps"]
    assert without_steps["below_floor_limit"] >= 0
    assert all(rise >= 0 for rise in without_steps["missed_rises_in_floor_resolutions"])
    assert "floor resolutions" in out.stdout


def test_without_steps_a_slow_leak_under_a_tall_sawtooth_is_found_at_its_rate():
    # 400 MiB over 30 minutes under 12 GiB of activations: each window's minimum misses the
    # floor by up to hundreds of MiB, the floor's line under all the samples does not (issue
    # 31.3; the detector before it said "no significant growth").
    rate = 400 * MiB / 1800
    times, values = sampled_sawtooth(1800, rate, activations=12 * GiB, step_time=2.3)
    estimate = detect([], [], [], times, values, 8 * GiB)
    assert estimate.detected, estimate.reason
    assert estimate.bytes_per_second == pytest.approx(rate, rel=0.5)


def server_allocated(kind: str, seconds: float = 1800, seed: int = 2):
    """An inference server's allocated bytes at ~1 Hz: weights, request bursts, and a KV cache
    filling to its budget in its first 40 s (the first requests) then staying (kv_fill), or the
    model reloaded every 5 minutes, 20 s near empty each time (reload)."""
    rng = random.Random(seed)
    times, values, live = [], [], []
    t = T0
    while t - T0 < seconds:
        t += rng.uniform(0.9, 1.1)
        if rng.random() < 0.8:
            live.append((t + rng.uniform(0.5, 8), rng.uniform(0.1, 1.5) * GiB))
        live = [(until, size) for until, size in live if until > t]
        value = 20 * GiB + sum(size for _, size in live)
        if kind == "kv_fill":
            value += 12 * GiB * min(1.0, (t - T0) / 40)
        if kind == "reload" and (t - T0) % 300 > 280:
            value = 300 * MiB
        times.append(t)
        values.append(float(int(value) // 512 * 512))
    return times, values


@pytest.mark.parametrize("kind", ["bursts", "kv_fill", "reload"])
def test_a_server_without_steps_is_not_a_leak_at_any_moment(kind):
    times, values = server_allocated(kind)
    alarms = [
        round(times[i - 1] - T0)
        for i in range(60, len(times) + 1, 30)
        if detect([], [], [], times[:i], values[:i], 40 * GiB).detected
    ]
    assert not alarms, f"called a leak at {alarms} s"


def _leak_eval():
    """bench/leak_eval.py's generators: the evaluation's own series (issue 31.3)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    try:
        import leak_eval
    finally:
        sys.path.pop(0)
    return leak_eval


# Per (seed, floors): the evaluation's generators, their states at the start of each server-shaped
# series so far, and the series drawn in full.  The tests take seed 5's servers #26, #40 and #67
# and seed 6's #55: the series before them are drawn without their floor readings (the readings'
# generator advanced past them all the same), a third of a full draw, once for the module.
_SERVERS: dict[tuple[int, bool], tuple[random.Random, random.Random | None, list, dict]] = {}


def _eval_server(seed: int, index: int, floors: bool = False):
    """The evaluation's `index`-th server-shaped series of `--seed seed` (`floors`: with the
    agent's floor readings, as the evaluation draws them)."""
    bench = _leak_eval()
    if (seed, floors) not in _SERVERS:
        readings = random.Random(seed + 3_000_003) if floors else None
        _SERVERS[(seed, floors)] = (random.Random(seed + 1_000_003), readings, [], {})
    rng, readings, starts, drawn = _SERVERS[(seed, floors)]
    kinds = bench.SERVER_KINDS
    while len(starts) <= index:
        starts.append((rng.getstate(), readings.getstate() if readings else None))
        # The main generator's draws are the same with floor readings or without.
        skipped = bench.server_series(rng, kinds[(len(starts) - 1) % len(kinds)])
        if readings is not None:
            bench.skip_server_floor_readings(readings, skipped.times)
    if index not in drawn:
        state, reading_state = starts[index]
        again = random.Random()
        again.setstate(state)
        again_readings = None
        if reading_state is not None:
            again_readings = random.Random()
            again_readings.setstate(reading_state)
        drawn[index] = bench.server_series(again, kinds[index % len(kinds)], again_readings)
    return drawn[index]


def _eval_time_leak(seed: int, index: int, floors: bool = False):
    """The evaluation's `index`-th leak without steps of `--seed seed` (its generator's draws
    replayed, the per-step series among them included; `floors`: with the agent's floor
    readings, as the evaluation draws them)."""
    bench = _leak_eval()
    rng = random.Random(seed)
    readings = random.Random(seed + 2_000_003) if floors else None
    found = -1
    for i in range(5 * (index + 1)):
        if i % 5 == 4:
            s = bench.time_series(rng, True, readings)
            found += 1
            if found == index:
                return s
        else:
            bench.step_series(
                rng, ["leak", "leak_after_warmup", "leak_with_jump", "leak_with_spikes"][i % 5]
            )
    raise AssertionError("unreachable")


@pytest.mark.parametrize("index", [1, 10, 16])
def test_a_kv_cache_filling_with_the_first_requests_is_not_a_leak_at_any_round(index):
    # The evaluation's servers whose KV cache fills in its first 10-60 s under request bursts:
    # the window minima of the first minute and a half rose with the fill, and the detector
    # before the floor test called each a leak of ~300 MiB/s at 80-88 s (issue 31.3).
    s = _eval_server(1, index)
    assert s.kind == "server_kv_fill"
    alarms = [
        round(s.times[i - 1] - s.times[0])
        for i in range(10, len(s.times) + 1, 10)
        if s.times[i - 1] >= s.grade_from
        and detect([], [], [], s.times[:i], s.values[:i], 40 * GiB).detected
    ]
    assert not alarms, f"called a leak at {alarms} s"


def test_a_slow_leak_without_steps_whose_floor_rises_significantly_is_found_at_its_rate():
    # 255 KiB/s (450 MiB over 30 min) under a 10 GiB sawtooth: the floor's window minima rise
    # with Mann–Kendall z above 4, but the detector before the floor test said "a slight rise,
    # still within the noise" (the minima's spread above the floor is not noise around a line).
    s = _eval_time_leak(1, 4)
    estimate = detect([], [], [], s.times, s.values, 8 * GiB)
    assert estimate.detected, estimate.reason
    assert estimate.bytes_per_second == pytest.approx(s.rate, rel=0.5)
    assert "Mann–Kendall z" in estimate.reason  # the verdict says what it rests on


def test_the_floor_limit_of_the_evaluation_is_what_a_healthy_floor_reaches():
    # bench/leak_eval.py's FLOOR_LIMIT: a leak whose floor rose less than this many floor
    # resolutions (a sawtooth's height over its samples) is beyond any test of the floor.  The
    # rise of the lower hull's line (the floor's best line) over healthy sawtooths: centred on
    # 0, past 4 resolutions in a tenth of them, so a limit of a few resolutions would be wrong.
    bench = _leak_eval()
    rises = bench.floor_null(200, samples=800)
    assert abs(rises[len(rises) // 2]) < 2
    assert 4 < rises[int(0.9 * len(rises))] < bench.FLOOR_LIMIT


def test_the_evaluation_measures_a_leak_without_steps_in_floor_resolutions():
    # Seed 2's 2nd leak without steps grows 45 MiB in 30 min under a 19.4 GiB sawtooth: 6 floor
    # resolutions, below the floor's limit (issue 31.3: the goal's misses are mostly such leaks).
    bench = _leak_eval()
    s = _eval_time_leak(2, 1)
    rise = s.rate * (s.times[-1] - s.times[0])
    # The resolution is the sawtooth's height over its samples, as the samples show it.
    height = max(s.values) - min(s.values) - rise
    assert s.floor_step == pytest.approx(height / len(s.times), rel=0.02)
    assert 3 < rise / s.floor_step < bench.FLOOR_LIMIT


# ------------------------------------------------------------------ floor readings (issue 31.3)
# While a viewer watches a process without steps, its agent reads allocated ~10 times between
# two samples and sends the lowest (`allocated_floor_bytes`): the floor seen ten times finer.


def test_a_leak_the_samples_miss_is_found_on_the_agents_floor_readings():
    # Seed 2's 2nd leak without steps: 45 MiB in 30 min under a 19.4 GiB sawtooth, 6 floor
    # resolutions of its 1 Hz samples: missed on them, found on the floor readings.
    s = _eval_time_leak(2, 1, floors=True)
    assert len(s.floors) == len(s.values)
    assert not detect([], [], [], s.times, s.values, 8 * GiB).detected
    estimate = detect([], [], [], s.times, s.values, 8 * GiB, history_floor=s.floors)
    assert estimate.detected, estimate.reason
    assert estimate.bytes_per_second == pytest.approx(s.rate, rel=0.25)


def test_floor_readings_fall_back_to_allocated_where_a_sample_has_none():
    # A viewer that began on an agent without them, or a connection's first sample: NaN there.
    s = _eval_time_leak(2, 1, floors=True)
    half = len(s.floors) // 2
    patchy = [math.nan] * half + s.floors[half:]
    assert floor_values(s.values, patchy) == s.values[:half] + s.floors[half:]
    assert floor_values(s.values, None) == s.values
    # A floor above the sample's own allocated (an agent that got it wrong) is not believed.
    assert floor_values([10.0, 10.0], [5.0, 20.0]) == [5.0, 10.0]


def _judged_every_ten_samples(s):  # type: ignore[no-untyped-def]
    """A series without steps judged on its floor readings as the dashboard judges it, every
    10 samples: (seconds since its start, whether that round is graded, the estimate)."""
    for i in range(10, len(s.times) + 1, 10):
        estimate = detect(
            [], [], [], s.times[:i], s.values[:i], 40 * GiB, history_floor=s.floors[:i]
        )
        yield s.times[i - 1] - s.times[0], s.times[i - 1] >= s.grade_from, estimate


def _floor_alarms(s) -> list[int]:  # type: ignore[no-untyped-def]
    """The graded rounds (seconds since the start) at which `s` was called a leak."""
    return [
        round(at)
        for at, graded, estimate in _judged_every_ten_samples(s)
        if graded and estimate.detected
    ]


@pytest.mark.parametrize("index", range(3))
def test_a_server_with_floor_readings_is_not_a_leak_at_any_round(index):
    # The evaluation's servers (bursts, a KV cache filling, reloads), judged every 10 samples on
    # their floor readings: the requests that end between samples lower the floor, and must not
    # read as a climb.
    s = _eval_server(2, index, floors=True)
    alarms = _floor_alarms(s)
    assert not alarms, f"{s.kind} called a leak at {alarms} s"


@pytest.mark.parametrize(
    ("seed", "index", "kind", "alarmed_at"),
    [
        (5, 40, "server_kv_fill", 1494),
        (5, 67, "server_kv_fill", 603),
        (4, 1, "server_kv_fill", 870),
        (5, 26, "server_reload", 556),
    ],
)
def test_a_fill_or_a_reload_seen_on_floor_readings_does_not_start_a_climb(
    seed, index, kind, alarmed_at
):
    # The evaluation's servers that alarmed on their floor readings (issue 31.3): a KV cache
    # filling in its first bin or two of the rolling minima (too short for a break, too noisy
    # under request bursts for one), or cut by a break at the bin where it still rose (seed 4's
    # #1: the fill's last 2 GiB set the first window below all the others), and a model
    # reloaded (the floor near nothing for 20 s, then back 1 GiB higher: the dip outweighed the
    # level change, so no break was found).  Each was called a leak of 115-170 MiB per minute.
    s = _eval_server(seed, index, floors=True)
    assert s.kind == kind
    alarms = []
    for at, graded, estimate in _judged_every_ten_samples(s):
        if graded and estimate.detected:
            alarms.append(round(at))
        if abs(at - alarmed_at) < 5:
            # Where it alarmed: the regime now starts after the fill, or after the reload.
            assert estimate.since is not None and estimate.since > s.times[0], estimate.reason
    assert not alarms, f"{s.kind} called a leak at {alarms} s"


def test_a_fill_whose_floor_rose_on_with_its_requests_waits_for_three_minutes():
    # Seed 6's server #55: a KV cache filled in under a minute, and the floor went on rising
    # with the requests in flight until 125 s; at 147 s its first 2.5 minutes read as a leak of
    # 2.5 GiB per minute (issue 31.3).  Nothing the floor showed then told it from one: a
    # regime is judged after three minutes, a fill's minute and two of its plateau.
    s = _eval_server(6, 55, floors=True)
    assert s.kind == "server_kv_fill"
    alarms = _floor_alarms(s)
    assert not alarms, f"called a leak at {alarms} s"


def test_a_leak_after_a_cache_fill_is_found_from_where_the_fill_stopped():
    # The regime restarts where the fill stopped, so a leak beneath it still counts (and a
    # rate is measured on the climb alone, not the fill).
    rng = random.Random(7)
    rate = 2 * MiB  # per second
    times, values, floors = [], [], []
    t = T0
    while t - T0 < 900:
        t += rng.uniform(0.9, 1.1)
        fill = 6 * GiB * min(1.0, (t - T0) / 30)
        floor = 20 * GiB + fill + rate * (t - T0)
        times.append(t)
        floors.append(float(int(floor) // 512 * 512))
        values.append(floors[-1] + rng.uniform(0, 2) * GiB)
    estimate = detect([], [], [], times, values, 40 * GiB, history_floor=floors)
    assert estimate.detected, estimate.reason
    assert estimate.bytes_per_second == pytest.approx(rate, rel=0.1)
    assert estimate.since is not None and estimate.since - T0 >= 20


def test_the_break_search_centres_x_once_and_finds_the_same_breaks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The search for a regime change tries every candidate break; x's mean and spread are the
    # same for all of them, so they are worked out once per search (this runs on the
    # dashboard's thread for every agent, every round: issue 35 item 8), and the breaks found
    # are the very same numbers as residualising each candidate from scratch.
    from memtop.diagnosis import leak

    def reference(xs: list[float], ys: list[float]) -> tuple[object, ...]:
        n = len(xs)
        ry = leak._residuals_on(xs, ys)
        best = {"jump": (None, 0.0), "bend": (None, 0.0)}
        for k in range(2, n - 2):
            knee = xs[k]
            for kind, regressor in (
                ("jump", [0.0 if x < knee else 1.0 for x in xs]),
                ("bend", [max(0.0, x - knee) for x in xs]),
            ):
                rd = leak._residuals_on(xs, regressor)
                sdd = sum(d * d for d in rd)
                if sdd <= 0:
                    continue
                sdy = sum(d * r for d, r in zip(rd, ry, strict=True))
                gain = sdy * sdy / sdd
                if gain > best[kind][1]:
                    best[kind] = (k, gain)
        return best["jump"] + best["bend"]

    rng = random.Random(35)
    for trial in range(60):
        n = rng.randrange(8, 60)
        xs = sorted(rng.uniform(0, 1000) for _ in range(n)) if trial % 2 else list(range(n))
        if trial % 5 == 0:  # ties: a knee shared by several bins
            xs = sorted(float(rng.randrange(0, n // 2)) for _ in range(n))
        if trial % 7 == 0:  # x not ascending (steps numbered again after a restart)
            rng.shuffle(xs)
        ys = [rng.gauss(0, 1e6) + (2e4 * x if trial % 3 else 0.0) for x in xs]
        if trial % 4 == 0:  # a jump
            ys = [y + (5e6 if i > n // 2 else 0.0) for i, y in enumerate(ys)]
        found = leak._find_breaks([float(x) for x in xs], ys)
        assert (found.jump_at, found.jump_gain, found.bend_at, found.bend_gain) == reference(
            [float(x) for x in xs], ys
        ), trial

    calls = [0]
    residuals_on = leak._residuals_on

    def counted(xs, ys):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return residuals_on(xs, ys)

    monkeypatch.setattr(leak, "_residuals_on", counted)
    xs = [float(x) for x in range(40)]
    leak._find_breaks(xs, [rng.gauss(0, 1e6) for _ in xs])
    assert calls[0] == 1  # y's residuals; each candidate's reuse the centred x (was 73 here)


def test_the_fill_search_fits_each_knee_once_and_finds_the_same_knee() -> None:
    # Where a server's cache stopped filling: every knee in the regime's first half is tried,
    # each a line up to it.  Each candidate's line is fitted once, y less its mean once for all
    # (a verdict without steps spent most of its time here, on the dashboard's thread), and the
    # knee, its gain and its residuals are the very numbers that fitting each candidate's slope
    # and then its residuals from scratch gives.
    from memtop.diagnosis import leak

    def slope(xs: list[float], ys: list[float]) -> float:
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0

    def reference(xs: list[float], ys: list[float]) -> tuple[int | None, float, float]:
        sse_line = sum(r * r for r in leak._residuals_on(xs, ys))
        best, best_gain, best_sse = None, 0.0, 0.0
        for k in range(1, len(xs) // 2 + 1):
            rising = [min(x, xs[k]) for x in xs]
            if slope(rising, ys) <= 0:
                continue
            sse = sum(r * r for r in leak._residuals_on(rising, ys))
            if sse_line - sse > best_gain:
                best, best_gain, best_sse = k, sse_line - sse, sse
        return best, best_gain, best_sse

    rng = random.Random(31)
    knees = 0
    for trial in range(80):
        n = rng.randrange(8, 60)
        xs = sorted(rng.uniform(0, 1800) for _ in range(n))
        fill_until = rng.uniform(60, 700)
        fill = rng.uniform(1, 12) * GiB if trial % 4 else 0.0  # a quarter flat
        noise = rng.choice([1, 16, 256]) * MiB
        ys = [20 * GiB + fill * min(1.0, x / fill_until) + rng.gauss(0, noise) for x in xs]
        if trial % 9 == 0:  # levels that repeat: ties in the sums
            ys = [float(int(y) // GiB * GiB) for y in ys]
        assert leak._best_knee(xs, ys) == reference(xs, ys), trial
        knees += leak._fill_end(xs, ys) is not None
    assert 10 < knees < 70, knees  # fills found and not: both verdicts were put to the test


def test_a_verdict_without_steps_reduces_each_regime_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # A verdict without steps looks for restarts in the floor, then a level change, then
    # restarts again: each on the regime's rolling minima, and 60 % of those reductions (43 %
    # of the restart searches) were of a regime already reduced in the same verdict.  Each is
    # worked out once now; the verdicts are the same (bench/leak_eval.py's series alike).
    from memtop.diagnosis import leak

    reductions: list[tuple[int, float]] = []
    searches: list[tuple[float, ...]] = []
    rolling_minimum, floor_restart = leak._rolling_minimum, leak._floor_restart

    def reducing(xs, ys, width):  # type: ignore[no-untyped-def]
        reductions.append((len(xs), xs[0]))
        return rolling_minimum(xs, ys, width)

    def searching(xs, ys):  # type: ignore[no-untyped-def]
        searches.append(tuple(xs))
        return floor_restart(xs, ys)

    monkeypatch.setattr(leak, "_rolling_minimum", reducing)
    monkeypatch.setattr(leak, "_floor_restart", searching)
    cut = 0
    for seed, index in ((4, 1), (5, 26), (2, 0)):  # a fill cut, a reload cut, bursts
        s = _eval_server(seed, index, floors=True)
        for i in range(300, len(s.times) + 1, 150):
            reductions.clear()
            searches.clear()
            estimate = detect([], [], [], s.times[:i], s.values[:i], 40 * GiB, s.floors[:i])
            assert len(set(reductions)) == len(reductions), (seed, index, i, reductions)
            assert len(set(searches)) == len(searches), (seed, index, i)
            cut += estimate.since is not None and estimate.since > s.times[0]
    assert cut  # regimes were cut: the restart search ran again on a later regime


def test_mann_kendall_counts_each_pair_once_as_the_pairwise_definition_does() -> None:
    # S, the sum over every pair i < j of sign(y_j - y_i), is counted by keeping the later
    # points sorted (two bisections a point), not by comparing every pair in Python: the
    # leak verdict runs it two or three times on 40 bins, on the dashboard's thread (issue 35
    # item 8).  The same z for the same points, ties and NaN included.
    from memtop.diagnosis import leak

    def pairwise_s(ys: list[float]) -> int:
        s = 0
        for i in range(len(ys)):
            for j in range(i + 1, len(ys)):
                s += (ys[j] > ys[i]) - (ys[j] < ys[i])
        return s

    rng = random.Random(8)

    class Counted(float):
        comparisons = 0

        def __lt__(self, other: object) -> bool:
            Counted.comparisons += 1
            return float(self) < float(other)  # type: ignore[arg-type]

        def __gt__(self, other: object) -> bool:
            Counted.comparisons += 1
            return float(self) > float(other)  # type: ignore[arg-type]

    points = [Counted(rng.gauss(0, 1e6) + 3e4 * i) for i in range(200)]
    leak._mann_kendall_z(points)
    # 19,900 pairs compared one by one before; a bisection's handful per point now.
    assert Counted.comparisons < 5000

    for trial in range(300):
        n = rng.randrange(0, 70)
        ys = [rng.gauss(0, 1e6) + 3e4 * i * (trial % 3) for i in range(n)]
        if trial % 4 == 0:  # ties
            ys = [float(int(y) // 262144 * 262144) for y in ys]
        if trial % 9 == 0 and ys:  # a NaN compares false with everything
            ys[rng.randrange(len(ys))] = math.nan
        assert leak._kendall_s(ys) == pairwise_s(ys), trial
