"""How well the leak detector separates leaks from everything else a baseline does.

    .venv/bin/python bench/leak_eval.py [--series 400] [--seed 1] [--wrong]

A labelled set of synthetic series is generated; the detector is run on each the way the
dashboard runs it: at checkpoints every 10 steps (every 10 s for series without steps) on all
the data so far.

Leaks (label 1): per-step rates log-uniform from 64 KiB to 64 MiB, Gaussian noise with a standard
deviation of 0 to 20× the rate, optionally after a warm-up ramp, with one-off level shifts, with
spikes (a bigger batch), with step-time jitter and pauses, with 0-30 % of the marks missing; and
time-only series (no step marks: a sawtooth sampled at 1 Hz for 30 min whose floor climbs).

Not leaks (label 0): a flat baseline with noise, a warm-up ramp that plateaus, a one-off level
shift up or down, spikes, and a time-only healthy sawtooth; and, scored apart
(`server_shaped`), inference servers without steps: request bursts, a KV cache filling to its
budget and staying, model reloads.

The headline figures are over the per-step series; the series without steps are scored apart
(`without_steps`).  A leak counts as detected when the last checkpoint says so with a rate
within a factor of 2 of the truth; steps to detect count from the first leaking step to the
first detection.  A series without a leak is a false alarm when any checkpoint says "leak",
except while a warm-up ramp is still indistinguishable from a leak: its checkpoints are graded
from twice the ramp's end.
A leak without steps is also measured in floor resolutions (its rise over the series divided by
the sawtooth's height over its samples: how near the lowest sample comes to the floor): the
output says how many rose less than `FLOOR_LIMIT` of them, beyond any test of the floor, and
lists the missed ones' rises (`--floor-null N` measures that limit on N healthy sawtooths).
The series without steps are judged again for each `--holdout` seed (2 and 3 unless told), seeds
the time basis was not tuned on; their figures are printed beside the others (`holdout`).
Each series without steps (the servers too) is also judged with the agent's floor readings
(memtop/agent/floor.py: the lowest of reads every 0.07-0.14 s between two samples, drawn from
generators of their own, so that the series are the seed's either way): the column "with floor
readings" and `without_steps_floor_readings` / `server_shaped_floor_readings`.  Measured at
this commit (before: the same series on their samples alone): seed 1 detection 1.0 (0.875),
false alarms 0.0125 (0.0125), servers 0.0 (0.0); held out, seed 2: 1.0 (0.8375), 0.0 (0.0),
0.0 (0.025); seed 3: 0.975 (0.875), 0.0 (0.0), 0.0 (0.0125).
`--wrong` also lists each series without steps judged wrong (a missed leak, a false alarm) by
its kind and index, on its 1 Hz samples or its floor readings, to be looked at.
The last line of output is one JSON object.

    .venv/bin/python bench/leak_eval.py --scenarios [--seeds 99] [--steps 100]
        [--traces shared/traces/cuda-h100] [--compare REV]

scores the detector on what it meets for real instead: the demo's `fragment` trainer (no leak:
a baseline that ramps up for 8 steps, then wanders as a moving sum of 8 steps' buffers) and its
`leak` trainer (8 MiB a step from step 1), seeds 1..N, every step marked (a loaded box: the
agent's 20-a-second limit no longer thins them) and judged after every mark as a dashboard does;
and the real H100 recordings, replayed sample by sample (`--traces`), whose truth is in their
README (only `leak` leaks).  It prints the false alarms and the first detecting step, and with
`--compare REV` the same for the detector as it was at git revision REV, side by side.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import itertools
import json
import math
import random
import statistics
import subprocess
import sys
import time
import types
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memtop.diagnosis.leak import detect
from memtop.engine.store import HISTORY_SAMPLES
from memtop.model import MARK_WINDOW

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
STEPS = 800
CHECK_EVERY = 10
# Without step marks the floor of a sampled sawtooth is a much noisier signal than per-step
# baselines; such series run for 30 minutes (a user without steps waits longer for a verdict).
TIME_ONLY_SECONDS = 1800


@dataclass
class Series:
    kind: str
    leak: bool
    rate: float  # true bytes per step (per second for time-only series)
    steps: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    grade_from: float = 30  # first step (or second) at which a false alarm counts
    leak_from: float = 0  # first step (or second) at which the leak runs
    time_only: bool = False
    # Without steps: how near the lowest sample comes to a sawtooth's floor, on average (its
    # height over the samples, `floor_resolution`); 0 where that is not defined (servers).
    floor_step: float = 0.0
    # Without steps: the agent's floor reading at each sample (the lowest of its readings at
    # ~10 Hz since the previous sample and the sample itself; `floor_readings`).
    floors: list[float] = field(default_factory=list)


def _round(v: float) -> float:
    return float(max(0, int(v) // 512 * 512))  # the allocator rounds to 512 B


def step_series(rng: random.Random, kind: str) -> Series:
    leak = kind.startswith("leak")
    rate = math.exp(rng.uniform(math.log(64 * KiB), math.log(64 * MiB))) if leak else 0.0
    # Noise: up to 20× the leak per step; for a flat baseline, up to 64 MiB.
    sigma = rng.uniform(0, 20) * rate if leak else rng.choice([0.0, rng.uniform(0, 64 * MiB)])
    base = rng.uniform(1, 40) * GiB
    step_time = math.exp(rng.uniform(math.log(0.05), math.log(2.0)))
    missing = rng.uniform(0, 0.3)
    s = Series(kind, leak, rate)
    ramp_len = rng.randint(10, 150)
    ramp_amount = rng.uniform(64 * MiB, 4 * GiB)
    jump_at = rng.randint(60, STEPS - 60)
    jump = rng.uniform(64 * MiB, 4 * GiB) * rng.choice([1, -1])
    spikes = set(rng.sample(range(STEPS), 6))
    t = 1_700_000_000.0
    for step in range(STEPS):
        t += step_time * rng.uniform(0.7, 1.3)
        if rng.random() < 0.005:
            t += rng.uniform(10, 60)  # an eval or a checkpoint pauses training
        value = base + rng.gauss(0, sigma) if sigma else base
        if kind in ("warmup", "leak_after_warmup"):
            value += ramp_amount * min(1.0, step / ramp_len)
        if kind in ("jump", "leak_with_jump") and step >= jump_at:
            value += jump
        if kind in ("spikes", "leak_with_spikes") and step in spikes:
            value += rng.uniform(256 * MiB, 2 * GiB)
        if leak:
            value += rate * step
        if rng.random() < missing:
            continue
        s.steps.append(float(step))
        s.times.append(t)
        s.values.append(_round(value))
    if kind == "warmup":
        s.grade_from = 2 * ramp_len
    return s


# The agent's floor readings (memtop/agent/floor.py): allocated read every ~0.1 s between two
# samples while a viewer watches a process without steps, jittered as a selector loop's wake-ups
# on a busy box are.
READING_INTERVAL_S = (0.07, 0.14)


def floor_readings(
    readings: random.Random, since: float, until: float, value_at: Callable[[float], float]
) -> float:
    """The lowest of the values read every ~0.1 s (jittered) after `since` and before `until`,
    and at `until` itself (the sample's own read): what `allocated_floor_bytes` carries."""
    lowest = value_at(until)
    t = since + readings.uniform(*READING_INTERVAL_S)
    while t < until:
        lowest = min(lowest, value_at(t))
        t += readings.uniform(*READING_INTERVAL_S)
    return lowest


def time_series(rng: random.Random, leak: bool, readings: random.Random | None = None) -> Series:
    """No step marks: allocated sampled at ~1 Hz over a sawtooth of `step_time` periods.  With
    `readings` (a generator of its own, so that the series are those of the seed either way),
    also the agent's floor reading at each sample (`floor_readings`)."""
    step_time = rng.uniform(0.1, 3.0)
    rate_per_step = math.exp(rng.uniform(math.log(64 * KiB), math.log(64 * MiB))) if leak else 0
    rate = rate_per_step / step_time
    base = rng.uniform(1, 40) * GiB
    activations = rng.uniform(0.5, 20) * GiB
    s = Series("time_leak" if leak else "time_flat", leak, rate, time_only=True)
    t0 = 1_700_000_000.0
    t = t0

    def value_at(when: float) -> float:
        phase = ((when - t0) / step_time) % 1.0
        sawtooth = activations * (phase if phase < 0.6 else (1 - phase) / 0.4 * 0.6)
        return _round(base + rate * (when - t0) + sawtooth)

    last_sample = t0
    while t - t0 < TIME_ONLY_SECONDS:
        t += rng.uniform(0.9, 1.1)
        if rng.random() < 0.1:
            continue  # a sample missed (agent busy)
        s.times.append(t)
        s.values.append(value_at(t))
        if readings is not None:
            s.floors.append(floor_readings(readings, last_sample, t, value_at))
        last_sample = t
    s.floor_step = floor_resolution(0.6 * activations, len(s.times))
    s.grade_from = t0 + 60
    s.leak_from = t0
    return s


# The floor alone cannot tell a leak whose floor rose less than this many `floor_resolution`s
# over the series from a healthy sawtooth: the 99.9th percentile of that rise, one verdict, on a
# healthy sawtooth whose samples fall at independent phases, measured by the best estimator of
# the floor's line there is (the lower hull under all the samples, at the middle: the maximum
# likelihood line for a floor with noise above it): `--floor-null 2000` gives 7.7 at the 90th
# percentile, 20.7 at the 99th, 36.6 at the 99.9th.  A dashboard asks every round, and a real
# sawtooth's phases alias (a period near a multiple of the sampling interval), so healthy series
# reach far more at some round: 72 to 163 on each of this set's seeds 1-3 (the hull's line
# between the quarter points, with the sawtooth's true height).
FLOOR_LIMIT = 30


def floor_resolution(height: float, samples: int) -> float:
    """How near the lowest of `samples` samples falls, on average, to the floor of a noise
    spread evenly over `height` above it: the finest step at which any test can see the floor
    (a leak's rise is judged in these steps, `FLOOR_LIMIT`)."""
    return height / max(1, samples)


def floor_null(series: int, samples: int = 1620, seed: int = 1) -> list[float]:
    """The rise of the lower hull's middle edge, in floor resolutions, over healthy sawtooths
    sampled at independent phases (noise even over [0, 1) above a flat floor), sorted."""
    from memtop.diagnosis.leak import _hull_slope

    rng = random.Random(seed)
    rises = []
    for _ in range(series):
        times = [i + rng.uniform(-0.1, 0.1) for i in range(samples)]
        values = [rng.random() for _ in range(samples)]
        slope = _hull_slope(times, values) or 0.0
        rises.append(slope * (times[-1] - times[0]) / floor_resolution(1.0, samples))
    return sorted(rises)


def server_series(rng: random.Random, kind: str, readings: random.Random | None = None) -> Series:
    """No step marks, no leak: what an inference server's allocated bytes do, sampled at ~1 Hz
    for 30 min.  `bursts`: weights, then requests arriving at random, each holding its
    activations for a few seconds; `kv_fill`: a KV cache filling to its budget with the first
    requests (10-60 s) and staying there, under request bursts; `reload`: the model unloaded
    and loaded again every few minutes (tens of seconds near empty), sometimes a model of
    another size.  With `readings`, also the agent's floor reading at each sample: between two
    samples the requests then in flight end one by one (new ones arrive at the samples), the
    KV cache follows its fill, and a model being reloaded stays where the sample saw it."""
    base = rng.uniform(2, 40) * GiB
    per_request = rng.uniform(16 * MiB, 2 * GiB)
    arrivals = rng.uniform(0.05, 3.0)  # requests per second
    budget = rng.uniform(1, 30) * GiB
    fill_s = rng.uniform(10, 60)  # the first requests fill it (a fill over minutes is a leak)
    s = Series(f"server_{kind}", False, 0.0, time_only=True)
    t0 = 1_700_000_000.0
    t = t0
    live: list[tuple[float, float]] = []  # (until, bytes) of the requests in flight
    model = base
    reload_at = t0 + rng.uniform(120, 600)
    reload_until = 0.0
    last_sample = t0
    # The server's allocated from the last sample on (None: before the first sample).
    between: Callable[[float], float] | None = None
    while t - t0 < TIME_ONLY_SECONDS:
        dt = rng.uniform(0.9, 1.1)
        t += dt
        for _ in range(_poisson(rng, arrivals * dt)):
            live.append((t + rng.uniform(0.5, 8.0), per_request * rng.uniform(0.2, 1.0)))
        live = [(until, size) for until, size in live if until > t]
        value = model + sum(size for _, size in live)
        if kind == "kv_fill":
            value += budget * min(1.0, (t - t0) / fill_s)
        if kind == "reload":
            if reload_until == 0.0 and t >= reload_at:
                reload_until = t + rng.uniform(10, 40)
            if reload_until:
                if t < reload_until:
                    value = rng.uniform(0, 512 * MiB)  # unloaded: the context and little else
                else:
                    reload_until = 0.0
                    reload_at = t + rng.uniform(120, 600)
                    if rng.random() < 0.3:
                        model = base * rng.uniform(0.5, 1.5)  # another model
        if readings is not None:
            state = _server_between(kind, t0, t, model, budget, fill_s, live, value, reload_until)
        if rng.random() < 0.1:
            if readings is not None and between is not None:
                # Missed by the viewer, read by the agent all the same.
                between = _chain(between, t, state)
            continue
        s.times.append(t)
        s.values.append(_round(value))
        if readings is not None:
            lowest = _round(value)
            if between is not None:
                lowest = min(lowest, floor_readings(readings, last_sample, t, between))
            s.floors.append(lowest)
            between = state
        last_sample = t
    s.grade_from = t0 + 60
    return s


def skip_server_floor_readings(readings: random.Random, times: Sequence[float]) -> None:
    """Advance `readings` past a server series' floor readings as `server_series` draws them
    (between each two of its samples, `times`), reading nothing: to reach a later series of a
    seed without working out the floors of every series before it (test_leak's servers #55
    and #67 drew 55 and 67 series in full)."""
    for since, until in itertools.pairwise(times):
        floor_readings(readings, since, until, _nothing)


def _nothing(when: float) -> float:
    return 0.0


def _server_between(
    kind: str,
    t0: float,
    t: float,
    model: float,
    budget: float,
    fill_s: float,
    live: list[tuple[float, float]],
    value: float,
    reload_until: float,
) -> Callable[[float], float]:
    """A server's allocated after its sample at `t`, until the next: the requests in flight
    end one by one, the KV cache fills on; while reloading, the level the sample saw."""
    if reload_until and t < reload_until:
        return lambda when: _round(value)
    held = list(live)
    # The bytes in flight change only as a request ends: summed once per number ended, in
    # `held`'s order (the same float as summing at each reading; ~10 readings a sample made
    # this sum most of the evaluation's and test_leak's time).
    ends = sorted(until for until, _ in held)
    in_flight: dict[int, float] = {}

    def allocated(when: float) -> float:
        ended = bisect.bisect_right(ends, when)
        if ended not in in_flight:
            in_flight[ended] = sum(size for until, size in held if until > when)
        return _round(
            model
            + in_flight[ended]
            + (budget * min(1.0, (when - t0) / fill_s) if kind == "kv_fill" else 0.0)
        )

    return allocated


def _chain(
    before: Callable[[float], float], at: float, after: Callable[[float], float]
) -> Callable[[float], float]:
    """`before` until `at`, then `after`."""
    return lambda when: before(when) if when < at else after(when)


def _poisson(rng: random.Random, mean: float) -> int:
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


SERVER_KINDS = ("bursts", "kv_fill", "reload")


def evaluate(s: Series, floors: bool = False) -> tuple[bool, float | None, float | None]:
    """(alarm in the graded part / detected at the end, first detection point, final rate).
    `floors`: a series without steps judged with its floor readings (`Series.floors`)."""
    first_detection = None
    alarm = False
    final = None
    if s.time_only:
        checkpoints = [i for i in range(1, len(s.times)) if i % CHECK_EVERY == 0]
        checkpoints.append(len(s.times))
        for i in checkpoints:
            floor = s.floors[:i] if floors else None
            est = detect([], [], [], s.times[:i], s.values[:i], 10 * GiB, history_floor=floor)
            final = est
            if est.detected:
                first_detection = first_detection or s.times[i - 1]
                if s.times[i - 1] >= s.grade_from:
                    alarm = True
        rate = final.bytes_per_second if final else None
    else:
        for end in range(CHECK_EVERY, STEPS + 1, CHECK_EVERY):
            i = sum(1 for x in s.steps if x < end)
            est = detect(s.steps[:i], s.times[:i], s.values[:i], [], [], 10 * GiB)
            final = est
            if est.detected:
                if first_detection is None:
                    first_detection = float(end)
                if end >= s.grade_from:
                    alarm = True
        rate = final.bytes_per_step if final else None
    detected = bool(final and final.detected)
    if s.leak:
        ok = detected and rate is not None and 0.5 * s.rate <= rate <= 2 * s.rate
        return ok, first_detection, rate
    return alarm, first_detection, rate


# ------------------------------------------------------------------ the demo and the recordings

Detect = Callable[..., Any]
TRACE_LEAKS = {"leak"}  # the recordings' ground truth (shared/traces/README.md)


def detector_at(rev: str) -> Detect:
    """`detect` as memtop/diagnosis/leak.py was at git revision `rev` (for before/after)."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{rev}:memtop/diagnosis/leak.py"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    name = f"leak_at_{rev.replace('~', '_').replace('^', '_')}"
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:leak.py", "exec"), module.__dict__)
    return module.detect  # type: ignore[no-any-return]


def scenario_baselines(scenario: str, seed: int, steps: int) -> list[float]:
    """Allocated bytes right after each step of the demo's `scenario` trainer (the simulated
    allocator on an 80 GiB device, run here without pacing)."""
    from memtop.sim.allocator import SimulatedCachingAllocator
    from memtop.sim.device import LocalDeviceMemory
    from memtop.sim.scenarios import Workload, model_for

    allocator = SimulatedCachingAllocator(LocalDeviceMemory(80 * GiB), 0)
    workload = Workload(scenario, allocator, model_for(scenario, 80 * GiB), seed, pace=None)
    out = []
    for _ in range(steps):
        workload.step()
        out.append(float(allocator.memory_allocated()))
    return out


def first_alarm_every_mark(detect_fn: Detect, values: list[float]) -> int | None:
    """The first step whose verdict, on all the marks so far, is a leak (marks at every step,
    0.05 s apart, as on a loaded box), or None."""
    marks = [float(step) for step in range(1, len(values) + 1)]
    times = [1_700_000_000.0 + 0.05 * step for step in marks]
    for upto in range(1, len(values) + 1):
        if detect_fn(marks[:upto], times[:upto], values[:upto], [], [], 40 * GiB).detected:
            return upto
    return None


def read_trace(path: Path) -> list[tuple[float, list[tuple[float, float, float]], float, float]]:
    """A recording's samples: (time, the step marks it brought, allocated, headroom)."""
    samples = []
    with gzip.open(path, "rt") as lines:
        for line in lines:
            record = json.loads(line)
            if record.get("cmd") != "sample" or "reply" not in record:
                continue
            result = record["reply"].get("result") or {}
            devices = result.get("devices") or []
            if not devices:
                continue
            device = devices[0]
            stats = device.get("stats") or {}
            allocated = float(stats.get("allocated_bytes.all.current", 0))
            reserved = float(stats.get("reserved_bytes.all.current", 0))
            index = str(device["index"])
            marks = [
                (float(m["step"]), float(m["time"]), float(m["allocated_bytes"][index]))
                for m in result.get("step_marks") or []
                if index in (m.get("allocated_bytes") or {})
            ]
            headroom = float(device.get("free_bytes", 0)) + reserved - allocated
            samples.append((float(result["time"]), marks, allocated, headroom))
    return samples


def first_alarm_in_trace(detect_fn: Detect, path: Path) -> tuple[float | None, int, float | None]:
    """Replayed sample by sample, the detector judging after each as a dashboard does: (the
    newest step at the first alarm, how many samples alarmed, the rate at the end)."""
    steps: list[float] = []
    times: list[float] = []
    allocated: list[float] = []
    history_t: list[float] = []
    history_a: list[float] = []
    first = None
    alarms = 0
    estimate = None
    for t, marks, now_allocated, headroom in read_trace(path):
        for step, when, value in marks:
            steps.append(step)
            times.append(when)
            allocated.append(value)
        history_t.append(t)
        history_a.append(now_allocated)
        estimate = detect_fn(
            steps[-MARK_WINDOW:],
            times[-MARK_WINDOW:],
            allocated[-MARK_WINDOW:],
            history_t[-HISTORY_SAMPLES:],
            history_a[-HISTORY_SAMPLES:],
            headroom,
        )
        if estimate.detected:
            alarms += 1
            if first is None:
                first = steps[-1] if steps else t - history_t[0]
    rate = estimate.bytes_per_step if estimate is not None else None
    return first, alarms, rate


def scenarios_main(args: argparse.Namespace) -> None:
    detectors: dict[str, Detect] = {}
    if args.compare:
        detectors[args.compare] = detector_at(args.compare)
    detectors["now"] = detect
    started = time.perf_counter()
    result: dict[str, Any] = {}
    print(f"demo scenarios, seeds 1..{args.seeds} × {args.steps} steps, every step marked")
    for name, detect_fn in detectors.items():
        row: dict[str, Any] = {}
        for scenario in ("fragment", "leak"):
            firsts = {
                seed: first_alarm_every_mark(
                    detect_fn, scenario_baselines(scenario, seed, args.steps)
                )
                for seed in range(1, args.seeds + 1)
            }
            alarmed = sorted(seed for seed, first in firsts.items() if first is not None)
            found = [first for first in firsts.values() if first is not None]
            if scenario == "fragment":
                row["fragment_false_alarms"] = len(alarmed)
                row["fragment_alarmed_seeds"] = alarmed
                row["fragment_alarm_steps"] = sorted(found)
            else:
                row["leak_detected"] = len(alarmed)
                row["leak_detection_step"] = (
                    {"min": min(found), "median": statistics.median(found), "max": max(found)}
                    if found
                    else None
                )
        result[name] = row
        print(
            f"  {name:>10}: fragment false alarms {row['fragment_false_alarms']}/{args.seeds}"
            f" (seeds {row['fragment_alarmed_seeds']}, at steps {row['fragment_alarm_steps']});"
            f" leak detected {row['leak_detected']}/{args.seeds}, first at step"
            f" {row['leak_detection_step']}"
        )
    if args.traces:
        paths = sorted(Path(args.traces).glob("*.jsonl.gz"))
        print(f"H100 recordings in {args.traces}, replayed sample by sample")
        for path in paths:
            label = path.name.removesuffix(".jsonl.gz")
            truth = "leak" if label in TRACE_LEAKS else "no leak"
            for name, detect_fn in detectors.items():
                first, alarms, rate = first_alarm_in_trace(detect_fn, path)
                result[name][f"trace_{label}"] = {"first_alarm_step": first, "alarms": alarms}
                rate_text = "-" if rate is None else f"{rate / MiB:.2f} MiB/step"
                print(
                    f"  {label:<20} ({truth:<7}) {name:>10}: first alarm at step {first},"
                    f" {alarms} alarming samples, final rate {rate_text}"
                )
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))


def score(seed: int, series: int, with_steps: bool, wrong: bool = False) -> dict[str, Any]:
    """The labelled set of `seed`, judged; its table printed, its figures returned.  Without
    `with_steps` only the series without step marks are judged (the others are generated all
    the same, so that the random draws, and the series without steps, are those of `seed`).
    `wrong`: also print each series without steps judged wrong (a missed leak, a false alarm),
    by its kind and its index among that kind's series of the seed, so that it can be looked
    at (tests/test_leak.py rebuilds them: `_eval_server`, `_eval_time_leak`)."""
    rng = random.Random(seed)
    # The agent's floor readings draw from a generator of their own: the series stay the seed's.
    readings = random.Random(seed + 2_000_003)
    positive_kinds = ["leak", "leak_after_warmup", "leak_with_jump", "leak_with_spikes", "time"]
    negative_kinds = ["flat", "warmup", "jump", "spikes", "time"]
    hits: Counter[str] = Counter()
    totals: Counter[str] = Counter()
    alarms: Counter[str] = Counter()
    to_detect: list[float] = []
    # Without steps: each leak's rise over its series in floor resolutions (missed ones apart).
    floor_rises: list[float] = []
    missed_rises: list[float] = []
    seconds_to_detect: list[float] = []
    rate_errors: list[float] = []
    # The series without steps judged again with the agent's floor readings.
    floor_hits: Counter[str] = Counter()
    floor_alarms: Counter[str] = Counter()
    floor_missed_rises: list[float] = []
    floor_seconds_to_detect: list[float] = []
    # Without steps, what was judged wrong: (kind, index among the kind's series, floors).
    judged_wrong: list[tuple[str, int, bool]] = []
    for i in range(series):
        kind = positive_kinds[i % len(positive_kinds)]
        s = time_series(rng, True, readings) if kind == "time" else step_series(rng, kind)
        if not (with_steps or s.time_only):
            continue
        ok, first, rate = evaluate(s)
        totals[s.kind] += 1
        if s.floor_step:
            rise = s.rate * (s.times[-1] - s.times[0]) / s.floor_step
            floor_rises.append(rise)
            if not ok:
                missed_rises.append(rise)
        if s.time_only:
            found, first_found, _ = evaluate(s, floors=True)
            judged_wrong += [
                (s.kind, totals[s.kind] - 1, floors)
                for floors in (False, True)
                if not (ok, found)[floors]
            ]
            floor_hits[s.kind] += found
            if not found:
                floor_missed_rises.append(rise)
            elif first_found is not None:
                floor_seconds_to_detect.append(first_found - s.leak_from)
        if ok:
            hits[s.kind] += 1
            if first is not None:
                (seconds_to_detect if s.time_only else to_detect).append(first - s.leak_from)
            if rate and not s.time_only:
                rate_errors.append(abs(rate / s.rate - 1))
    for i in range(series):
        kind = negative_kinds[i % len(negative_kinds)]
        s = time_series(rng, False, readings) if kind == "time" else step_series(rng, kind)
        if not (with_steps or s.time_only):
            continue
        alarm, _, _ = evaluate(s)
        totals[s.kind] += 1
        alarms[s.kind] += alarm
        if s.time_only:
            floor_alarm = evaluate(s, floors=True)[0]
            floor_alarms[s.kind] += floor_alarm
            judged_wrong += [
                (s.kind, totals[s.kind] - 1, floors)
                for floors in (False, True)
                if (alarm, floor_alarm)[floors]
            ]
    # Server-shaped series (no leak, no steps) from a generator of their own, so the figures
    # above stay comparable with earlier runs.
    server_rng = random.Random(seed + 1_000_003)
    server_readings = random.Random(seed + 3_000_003)
    for i in range(series // 5):
        s = server_series(server_rng, SERVER_KINDS[i % len(SERVER_KINDS)], server_readings)
        alarm, _, _ = evaluate(s)
        totals[s.kind] += 1
        alarms[s.kind] += alarm
        floor_alarm = evaluate(s, floors=True)[0]
        floor_alarms[s.kind] += floor_alarm
        # The server's index among all the seed's servers (`_eval_server` takes that).
        judged_wrong += [
            (s.kind, i, floors) for floors in (False, True) if (alarm, floor_alarm)[floors]
        ]
    print(f"seed {seed}" + ("" if with_steps else " (held out: the series without steps only)"))
    print(
        f"{'kind':<20} {'series':>6} {'leak found / false alarm':>26} {'with floor readings':>20}"
    )
    for kind in sorted(totals):
        count = hits[kind] if "leak" in kind else alarms[kind]
        with_floor = ""
        if kind.startswith(("time_", "server_")):
            with_floor = str(floor_hits[kind] if "leak" in kind else floor_alarms[kind])
        print(f"{kind:<20} {totals[kind]:>6} {count:>26} {with_floor:>20}")

    def rates(kinds: list[str]) -> tuple[float | None, float | None]:
        leaks = [k for k in kinds if "leak" in k]
        others = [k for k in kinds if "leak" not in k]
        found = sum(hits[k] for k in leaks) / max(1, sum(totals[k] for k in leaks))
        false = sum(alarms[k] for k in others) / max(1, sum(totals[k] for k in others))
        return round(found, 4), round(false, 4)

    per_step = [k for k in totals if not k.startswith(("time_", "server_"))]
    servers = [k for k in totals if k.startswith("server_")]
    detection_rate, false_alarm_rate = rates(per_step)
    time_detection, time_false = rates([k for k in totals if k.startswith("time_")])
    result: dict[str, Any] = {}
    if with_steps:
        result = {
            "series": sum(totals[k] for k in per_step),
            "detection_rate": detection_rate,
            "false_alarm_rate": false_alarm_rate,
            "median_steps_to_detect": statistics.median(to_detect) if to_detect else None,
            "median_rate_error": (
                round(statistics.median(rate_errors), 4) if rate_errors else None
            ),
        }
    # The fallback without step marks (the floor over 30 min of 1 Hz samples), scored apart:
    # the headline figures are the per-step series.
    result["without_steps"] = {
        "series": sum(totals[k] for k in totals if k.startswith("time_")),
        "detection_rate": time_detection,
        "false_alarm_rate": time_false,
        "median_seconds_to_detect": (
            round(statistics.median(seconds_to_detect)) if seconds_to_detect else None
        ),
        # What the floor can tell: leaks whose floor rose less than FLOOR_LIMIT resolutions are
        # beyond any test of the floor; the missed ones' rises, in resolutions.
        "below_floor_limit": sum(1 for rise in floor_rises if rise < FLOOR_LIMIT),
        "missed_rises_in_floor_resolutions": sorted(round(rise) for rise in missed_rises),
    }
    if floor_rises:
        below = result["without_steps"]["below_floor_limit"]
        print(
            f"without steps: {below} of {len(floor_rises)} leaks rose less than {FLOOR_LIMIT}"
            " floor resolutions (the sawtooth's height over its samples), beyond any test of the"
            " floor; the missed ones rose"
            f" {result['without_steps']['missed_rises_in_floor_resolutions']}"
        )
    # Servers without steps that must not alarm (request bursts, a KV cache filling to its
    # budget and staying, model reloads), judged as the without-steps series are.
    result["server_shaped"] = {
        "series": sum(totals[k] for k in servers),
        "false_alarm_rate": round(
            sum(alarms[k] for k in servers) / max(1, sum(totals[k] for k in servers)), 4
        ),
    }
    # The same series judged with the agent's floor readings (the lowest of its reads at
    # ~10 Hz between the samples, `allocated_floor_bytes`), as a dashboard judges a process
    # without steps whose agent takes them.
    time_kinds = [k for k in totals if k.startswith("time_")]
    time_leaks = [k for k in time_kinds if "leak" in k]
    time_others = [k for k in time_kinds if "leak" not in k]
    result["without_steps_floor_readings"] = {
        "series": sum(totals[k] for k in time_kinds),
        "detection_rate": round(
            sum(floor_hits[k] for k in time_leaks) / max(1, sum(totals[k] for k in time_leaks)), 4
        ),
        "false_alarm_rate": round(
            sum(floor_alarms[k] for k in time_others) / max(1, sum(totals[k] for k in time_others)),
            4,
        ),
        "median_seconds_to_detect": (
            round(statistics.median(floor_seconds_to_detect)) if floor_seconds_to_detect else None
        ),
        "missed_rises_in_floor_resolutions": sorted(round(rise) for rise in floor_missed_rises),
    }
    result["server_shaped_floor_readings"] = {
        "series": sum(totals[k] for k in servers),
        "false_alarm_rate": round(
            sum(floor_alarms[k] for k in servers) / max(1, sum(totals[k] for k in servers)), 4
        ),
    }
    floor_result = result["without_steps_floor_readings"]
    print(
        f"without steps, with floor readings: detection {floor_result['detection_rate']},"
        f" false alarms {floor_result['false_alarm_rate']}, servers"
        f" {result['server_shaped_floor_readings']['false_alarm_rate']}; missed rises (1 Hz"
        f" resolutions) {floor_result['missed_rises_in_floor_resolutions']}"
    )
    if wrong:
        for kind, index, floors in judged_wrong:
            what = "missed" if "leak" in kind else "false alarm"
            basis = "floor readings" if floors else "1 Hz samples"
            print(f"judged wrong: {kind} #{index} ({what}, on its {basis})")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--series", type=int, default=400, help="series per label")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--wrong",
        action="store_true",
        help="also list the series without steps judged wrong (kind and index, to look at)",
    )
    parser.add_argument(
        "--holdout",
        type=int,
        nargs="*",
        default=[2, 3],
        metavar="SEED",
        help="also judge the series without steps of these seeds (not tuned on; none: skip)",
    )
    parser.add_argument(
        "--scenarios", action="store_true", help="score the demo's trainers and the recordings"
    )
    parser.add_argument("--seeds", type=int, default=99, help="--scenarios: seeds 1..N")
    parser.add_argument("--steps", type=int, default=100, help="--scenarios: steps per seed")
    parser.add_argument("--traces", help="--scenarios: a folder of recordings (*.jsonl.gz)")
    parser.add_argument("--compare", metavar="REV", help="--scenarios: also the detector at REV")
    parser.add_argument(
        "--floor-null",
        type=int,
        metavar="N",
        help="only: the floor line's rise on N healthy sawtooths, in resolutions (FLOOR_LIMIT)",
    )
    args = parser.parse_args()
    if args.floor_null:
        rises = floor_null(args.floor_null)
        quantiles = {
            str(q): round(rises[min(len(rises) - 1, int(q * len(rises)))], 1)
            for q in (0.5, 0.9, 0.99, 0.999)
        }
        print(json.dumps({"series": args.floor_null, "rise_quantiles": quantiles}))
        return
    if args.scenarios:
        scenarios_main(args)
        return
    started = time.perf_counter()
    result = score(args.seed, args.series, with_steps=True, wrong=args.wrong)
    print()
    result["holdout"] = {}
    for seed in args.holdout:
        # Seeds the time basis was not tuned on (issue 31.3 tuned on seed 1): its sets again,
        # the per-step series generated (so the rest are the same as with --seed) but not run.
        held = score(seed, args.series, with_steps=False, wrong=args.wrong)
        result["holdout"][str(seed)] = {
            key: held[key]
            for key in (
                "without_steps",
                "server_shaped",
                "without_steps_floor_readings",
                "server_shaped_floor_readings",
            )
        }
        print()
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
