"""Leak detection: is the memory a trainer keeps between steps growing, and how fast?

The signal is the per-step baseline: allocated bytes right after each optimizer step (DESIGN §5).
Within a step memory rises and falls (the sawtooth of activations); between steps a healthy
trainer comes back to the same level, and a leaking one does not.  Without step marks (a server,
a custom loop, an evaluation job) the baseline is the floor of the sampled allocated bytes: the
lowest sample of each of `FLOOR_WINDOWS` windows, tested the same way (`detect_from_history`);
where the agent sent floor readings (the lowest allocated it read at ~10 Hz between two
samples, memtop/agent/floor.py) each sample counts at its floor reading (`floor_values`).

The test has to be right more than clever, so it is built from robust, boring pieces:

- the series is reduced to at most `MAX_BINS` bin medians (or minima, for the time basis),
  which removes single-step spikes and keeps every later step O(bins²);
- regime changes (a level shift from a bigger batch or an OOM restart, the bend where a warm-up
  ramp levels off or a leak starts) are found by comparing a line with a line that breaks;
  analysis then continues on the regime after the newest break, so a one-off jump is not read
  as a slope and a finished warm-up is not a leak;
- the trend must be significant by the Mann–Kendall test over the regime and still rising in
  its newest third; the test's variance is widened by the baseline's own autocorrelation
  (`_autocorrelation_inflation`): a baseline that wanders (buffers kept for a few steps,
  marked at every step) is not a trend, however many marks repeat the wander;
- the rate is the Theil–Sen slope (median of pairwise slopes), which a few outliers do not move;
- the growth seen must be several times the baseline's own spread, and at least
  `MIN_GROWTH_BYTES`, so a trainer that pins a few hundred
  bytes per step is not flagged before it matters;
- a leak grows without bound, a baseline that remembers a few steps only wanders: a climb of
  less than `CLEAR_MULTIPLE` times the baseline's spread must also hold on medians of
  `MEMORY_STEPS` steps each and still climb in its newer half (`_persists`) before it is called
  a leak.  A clean climb (every real leak recorded so far) is called as soon as before.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from operator import le, mul
from typing import Any

from memtop.base.records import record
from memtop.figures.median import median
from memtop.figures.units import MiB, format_bytes, format_duration, short_bytes
from memtop.model import MARK_WINDOW, Choice

MIN_MARKS = 30  # fewer per-step baselines than this say nothing about a trend
MAX_MARKS = MARK_WINDOW  # the newest baselines looked at (minutes at typical step rates)
MAX_BINS = 40
MIN_BINS = 8
MIN_GROWTH_BYTES = 1 * MiB
Z_TREND = 3.09  # Mann–Kendall over the regime: one-sided p ≤ 0.001
F_BREAK = 25.0  # a line with a break must beat a line by this F ratio to count as a regime change
MAX_BREAKS = 3
# A break must also move the series by something that matters: this much per bin, as the root
# mean square of what it explains (a jump of MIN_GROWTH_BYTES mid-series explains about this).
# On a near-noiseless leak (8.00 MiB a step, to the byte) one bin 0.8 MiB off the line passed
# the F ratio, the regime was cut there, and the leak went unsaid for 30 steps.
MIN_BREAK_SHIFT_BYTES = MIN_GROWTH_BYTES / 4
NOISE_MULTIPLE = 3.0  # growth seen must exceed this many times the baseline's own spread
# A climb this many times the baseline's spread is a leak at once: the fragment demo's wander
# (a moving sum of 8 steps' buffers) reached 9.2 over 200 steps × 99 seeds, the H100 leak
# recording is at 230 by its 30th mark.  Below it the climb must persist (`_persists`).
CLEAR_MULTIPLE = 20.0
# How many steps a baseline may remember (buffers kept k steps, an EMA, the fragment demo's
# per-layer outputs kept 8): medians of this many steps are about independent of each other.
MEMORY_STEPS = 8
# Mann–Kendall on those medians: one-sided p ≤ 0.0001.  A dashboard asks again every round;
# at 3.09 one fragment seed of 99 still passed, 15 MiB up over its first 120 steps.
Z_PERSIST = 3.72
MIN_HISTORY_SECONDS = 60.0  # the time basis needs this much sampled history
MIN_WINDOW_SECONDS = 10.0  # rolling-minimum window of the time basis
# The windows whose minima find regime changes on the time basis (a reload, a new level).
TIME_BINS = 40
# The time basis's test (detect_from_history): the lowest sample of each of this many windows of
# the regime.  Fewer, longer windows each come nearer a sawtooth's floor (a window's minimum
# misses it by about the activations over its samples); more give the test more points.
#
# Why not a test of the floor's line under all the samples (the lower hull, which finds the floor
# to about the sawtooth's height over n samples, where a window's minimum finds it to its height
# over the window's samples): measured on bench/leak_eval.py's series without steps (issue 31.3),
# its rise over the spread of the windows' minima above it, the one scale-free form of it that
# also holds for servers, reaches 3.6-5.3 on healthy series and servers at some round, and is
# below 2.2 on 5 of 80 leaks of each seed; taking it beside Mann-Kendall gains 0-2 of 80 leaks.
# Even with the sawtooth's true height, the hull's rise on each seed's healthy series reaches
# 72-163 of those steps at some round (periods that alias with the sampling), above the
# 30-minute rise of 14-20 of the seed's 80 leaks, and 3-6 of them rose under 30, beyond one
# look at independent phases: the floor alone does not hold the evidence for them (the bench's
# `FLOOR_LIMIT`).
FLOOR_WINDOWS = 24
FLOOR_WINDOW_SAMPLES = 10  # at least this many samples a window
# A regime this long at least: the path is for slow leaks (fast ones are as clear after three
# minutes), and a server's first minutes (a KV cache filling with its first requests) are not a
# trend yet: a fill of up to a minute needs two minutes of its plateau beside it.  At 120 s, a
# fill under request bursts whose floor went on rising with the requests until 125 s read as a
# leak at 147 s (bench/leak_eval.py seed 6, server #55), and nothing the floor showed then told
# it from one.
FLOOR_MIN_SECONDS = 180.0
# Mann–Kendall on those minima: one-sided p ≤ 0.0001, as for a climb that must persist: a
# dashboard asks every round, and at 3.09 a healthy sawtooth whose sampling aliased its floor
# into a slow wander, and servers' request bursts, passed at some round in 4 of 160 series.
Z_FLOOR_TREND = 3.72
# A rise that stops in a regime's first half (a cache filling) starts the regime anew where
# it stopped, when a line up to a knee, flat after, beats one line by this F ratio.
F_FILL = 10.0
# Sen's interval at this z (95 %, two-sided) must hold the hull's slope for it to give the rate.
Z_SEN_INTERVAL = 1.96


class LeakBasis(Choice):
    """What a leak verdict was judged on (the JSON's `leak.basis`)."""

    STEPS = "steps"  # the per-step baselines
    TIME = "time"  # the rolling minimum over time (no steps seen)
    NONE = "none"  # too little data for either


@record(frozen=True, slots=True)
class LeakEstimate:
    """The verdict on one agent device.  The rates are the measured trend of the baseline even
    when it is not called a leak (then the time-to-full fields are None)."""

    detected: bool
    bytes_per_step: float | None
    bytes_per_second: float | None
    steps_to_full: int | None
    seconds_to_full: float | None
    confidence: float
    basis: LeakBasis
    samples: int
    since: float | None  # where the analysed regime starts: a step number, or a unix time
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "detected": self.detected,
            "bytes_per_step": _int_or_none(self.bytes_per_step),
            "bytes_per_second": _int_or_none(self.bytes_per_second),
            "steps_to_full": self.steps_to_full,
            "seconds_to_full": (
                None if self.seconds_to_full is None else round(self.seconds_to_full, 1)
            ),
            "confidence": round(self.confidence, 4),
            "basis": self.basis,
            "samples": self.samples,
            "since": self.since,
            "reason": self.reason,
        }


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else round(value)


def not_enough(reason: str, samples: int = 0) -> LeakEstimate:
    return LeakEstimate(False, None, None, None, None, 0.0, LeakBasis.NONE, samples, None, reason)


# ------------------------------------------------------------------------------ entry points


def detect(
    marks_step: Sequence[float],
    marks_time: Sequence[float],
    marks_allocated: Sequence[float],
    history_time: Sequence[float],
    history_allocated: Sequence[float],
    headroom_bytes: float | None,
    history_floor: Sequence[float] | None = None,
) -> LeakEstimate:
    """Per-step baselines when there are enough of them, else the rolling minimum over time.

    `history_floor`, beside `history_allocated`: the agent's floor readings (the lowest
    allocated it read at ~10 Hz since the previous sample, `allocated_floor_bytes`; NaN where a
    sample carried none).  The time basis judges the floor on them where present."""
    if len(marks_step) >= MIN_MARKS:
        return detect_from_steps(marks_step, marks_time, marks_allocated, headroom_bytes)
    if history_time and history_time[-1] - history_time[0] >= MIN_HISTORY_SECONDS:
        estimate = detect_from_history(
            history_time, floor_values(history_allocated, history_floor), headroom_bytes
        )
        if marks_step:
            # Steps are coming, just not enough yet: the time verdict stands, but say so.
            return _replace_reason(
                estimate, f"{estimate.reason} ({len(marks_step)}/{MIN_MARKS} steps so far)"
            )
        return estimate
    if marks_step:
        return not_enough(f"{len(marks_step)} of {MIN_MARKS} steps seen", len(marks_step))
    span = history_time[-1] - history_time[0] if history_time else 0.0
    return not_enough(
        f"no steps seen; {span:.0f} of {MIN_HISTORY_SECONDS:.0f} s of history", len(history_time)
    )


def floor_values(allocated: Sequence[float], floor: Sequence[float] | None) -> Sequence[float]:
    """Each sample's lowest reading: the lower of its allocated and the agent's floor reading
    where it sent one, else its allocated.

    Why: sampled at 1 Hz, the lowest of n samples of a sawtooth lands its height / n above the
    floor, and a slow leak's rise over 30 minutes can be less than healthy series' floors wander
    (bench/leak_eval.py's `FLOOR_LIMIT`).  The agent reads allocated ~10 times between samples
    while a viewer watches a process without steps: the floor is then seen ~10 times finer."""
    if floor is None or len(floor) != len(allocated):
        return allocated
    return [
        min(a, f) if f == f and f >= 0 else a  # NaN (no reading) fails f == f
        for a, f in zip(allocated, floor, strict=True)
    ]


def detect_from_steps(
    steps: Sequence[float],
    times: Sequence[float],
    allocated: Sequence[float],
    headroom_bytes: float | None,
) -> LeakEstimate:
    """Trend of the per-step baseline (x = step number; gaps from missed marks are fine)."""
    steps, times, allocated = steps[-MAX_MARKS:], times[-MAX_MARKS:], allocated[-MAX_MARKS:]
    n = len(steps)
    if n < MIN_MARKS:
        return not_enough(f"{n} of {MIN_MARKS} steps seen", n)

    def reduce(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
        return _bin_medians(xs, ys, MAX_BINS)

    first, trend = _analyse(steps, allocated, reduce, MIN_MARKS)
    regime_marks = n - first
    step_span = steps[-1] - steps[first]
    time_span = times[-1] - times[first]
    steps_per_second = step_span / time_span if time_span > 0 else None
    if trend is None:
        reason = (
            f"regime changed at step {steps[first]:.0f}; {regime_marks} of {MIN_MARKS} steps since"
        )
        return LeakEstimate(
            False, None, None, None, None, 0.0, LeakBasis.STEPS, n, steps[first], reason
        )
    per_step = trend.slope
    per_second = per_step * steps_per_second if steps_per_second else None
    detected, reason = _verdict(trend, per_step * step_span, "step")
    if detected and per_step * step_span < CLEAR_MULTIPLE * trend.noise:
        detected, reason = _persists(steps[first:], allocated[first:], reason)
    steps_to_full = seconds_to_full = None
    if detected and headroom_bytes is not None:
        steps_to_full = max(0, int(headroom_bytes / per_step))
        if steps_per_second:
            seconds_to_full = steps_to_full / steps_per_second
    return LeakEstimate(
        detected,
        per_step,
        per_second,
        steps_to_full,
        seconds_to_full,
        trend.confidence,
        LeakBasis.STEPS,
        n,
        steps[first],
        reason,
    )


def detect_from_history(
    times: Sequence[float], allocated: Sequence[float], headroom_bytes: float | None
) -> LeakEstimate:
    """Without steps: does the floor of the sampled allocated bytes rise, significantly?

    The floor is the lowest sample of each of up to `FLOOR_WINDOWS` equal windows of the regime
    (the regime found as for steps, on finer windows' minima).  Those minima are the test's
    points: under no leak they are exchangeable, whatever the shape of the noise above the
    floor (a sawtooth's activations, requests in flight), so Mann–Kendall on them (its variance
    widened by their lag-1 autocorrelation, as for steps) is a valid test, and Sen's confidence
    interval bounds their slope.  The verdict rests on that test alone; the lower hull of all the
    samples only sharpens the rate, and only where it lies inside that interval."""
    n = len(times)
    span = times[-1] - times[0] if n >= 2 else 0.0
    if span < MIN_HISTORY_SECONDS:
        return not_enough(f"no steps seen; {span:.0f} of {MIN_HISTORY_SECONDS:.0f} s of history", n)

    # Every series reduced here is a regime: `times` from some sample on, so its length names
    # it.  One verdict reduced the same regime, and looked for a restart in it, up to three
    # times (the restarts found, the level-change test, the restarts again: on bench/
    # leak_eval.py's series 60 % of the reductions and 43 % of the restart searches were
    # repeats, a third of the verdict's time): each is worked out once, the same numbers.
    reduced: dict[tuple[int, float | None], tuple[list[float], list[float]]] = {}

    def reduce(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
        key = (len(xs), xs[0] if xs else None)
        if key not in reduced:
            width = max(MIN_WINDOW_SECONDS, (xs[-1] - xs[0]) / TIME_BINS) if xs else 1.0
            reduced[key] = _rolling_minimum(xs, ys, width)
        bx, by = reduced[key]
        return list(bx), list(by)  # copies: a caller's are its own

    restarts: dict[int, tuple[float, str] | None] = {}

    def restart_from(first: int) -> tuple[float, str] | None:
        if first not in restarts:
            restarts[first] = _floor_restart(*reduce(times[first:], allocated[first:]))
        return restarts[first]

    # The level-change test looks for one break in a line; what a server's floor does at its
    # start (a cache filling, then full) or at a reload (everything given back, then loaded
    # again) is not such a break, and is cut before it (whose cut would keep the fill's end)
    # and after it.
    first, since = _after_restarts(times, restart_from, 0, "")
    if len(times) - first >= 2:
        change, _ = _analyse(times[first:], allocated[first:], reduce, 2)
        if change:
            first += change
            since = " since the level changed"
        first, since = _after_restarts(times, restart_from, first, since)
    regime_t, regime_y = times[first:], allocated[first:]
    regime_span = regime_t[-1] - regime_t[0]
    windows = min(FLOOR_WINDOWS, len(regime_t) // FLOOR_WINDOW_SAMPLES)
    if regime_span < FLOOR_MIN_SECONDS or windows < MIN_BINS:
        reason = f"watching the floor: {regime_span:.0f} of {FLOOR_MIN_SECONDS:.0f} s{since}"
        return LeakEstimate(
            False, None, None, None, None, 0.0, LeakBasis.TIME, n, times[first], reason
        )
    xs, ys = _window_minima(regime_t, regime_y, windows)
    slope = _theil_sen(xs, ys)
    inflation = _autocorrelation_inflation(xs, ys, slope)
    z = _mann_kendall_z(ys, inflation)
    confidence = _one_sided_confidence(z) if slope > 0 else 0.0
    low, high = _sen_interval(xs, ys, Z_SEN_INTERVAL * math.sqrt(inflation))
    per_second = slope
    hull = _hull_slope(regime_t, regime_y)
    if hull is not None and low <= hull <= high:
        per_second = hull  # the same floor, seen through every sample rather than 1 in 40
    growth = per_second * regime_span
    minutes = regime_span / 60
    newer = len(xs) // 2
    if slope <= 0 or z < Z_FLOOR_TREND:
        detected = False
        reason = f"the floor does not rise significantly over {minutes:.0f} min (z {z:.1f})"
    elif _theil_sen(xs[newer:], ys[newer:]) <= 0:
        detected = False
        reason = "the floor rose earlier and is flat lately (a cache filled, a warm-up)"
    elif growth < MIN_GROWTH_BYTES:
        detected = False
        reason = f"the floor rises, but only {growth / 1024:.0f} KiB so far"
    else:
        detected = True
        reason = (
            f"the floor (lowest sample of each of {len(xs)} windows) rises"
            f" {per_second * 60 / MiB:.2f} MiB per minute over {minutes:.0f} min"
            f" (Mann–Kendall z {z:.1f})"
        )
    seconds_to_full = None
    if detected and headroom_bytes is not None:
        seconds_to_full = max(0.0, headroom_bytes / per_second)
    return LeakEstimate(
        detected,
        None,
        per_second,
        None,
        seconds_to_full,
        confidence,
        LeakBasis.TIME,
        n,
        times[first],
        reason,
    )


def _after_restarts(
    times: Sequence[float],
    restart_from: Callable[[int], tuple[float, str] | None],
    first: int,
    since: str,
) -> tuple[int, str]:
    """The regime's first index after each restart from `first` on, and what it follows (""
    if nothing since the history began).  `restart_from(i)`: `_floor_restart` of the regime
    from sample i on, reduced."""
    for _ in range(MAX_BREAKS):
        if len(times) - first < 2:
            break
        cut = restart_from(first)
        if cut is None:
            break
        boundary, what = cut
        since = f" since {what}"
        if times[-1] < boundary:  # the floor has not settled since
            return len(times) - 1, since
        first = max(first, _first_index_at_or_after(times, boundary))
    return first, since


def _floor_restart(xs: list[float], ys: list[float]) -> tuple[float, str] | None:
    """Where the floor's regime starts again, with what happened there, or None: after the
    floor fell well below everywhere it stood before (memory given back: a model unloaded for
    a reload), or after a rise that stopped in the regime's first half (a cache filling to its
    budget).  `xs`, `ys`: the rolling minima of the regime so far.

    The regime starts after the bin where the floor came back up or levelled off: a bin's
    minimum is its earliest low, and the rise may go on within it (a cut at that bin's start
    kept a fill's last 2 GiB, set the first window below all the others, and seed 4's server
    #1 alarmed).

    Why: a leak never gives its memory back, and keeps rising.  Neither shape is a line with
    one break: a reload's dip (the floor near nothing for tens of seconds) outweighs the level
    change around it, and a fill over the regime's first bin or two is too short for a break
    (one is looked for from the third bin on) or, under request bursts, too noisy for
    `F_BREAK`.  Left in, the fill's rise or the dip sets the Mann–Kendall test's first windows
    below all the others: on bench/leak_eval.py's servers that alarmed 5 of 480 (4 fills, 1
    reload)."""
    n = len(xs)
    if n < MIN_BINS:
        return None
    width = (xs[-1] - xs[0]) / (n - 1)
    spread = _robust_spread(xs, ys, _theil_sen(xs, ys))
    margin = max(NOISE_MULTIPLE * spread, MIN_GROWTH_BYTES)
    low = min(range(n), key=ys.__getitem__)
    start = low
    while start > 0 and ys[start - 1] <= ys[low] + margin:
        start -= 1  # already down
    if start > 0 and ys[low] < min(ys[:start]) - margin:
        end = low
        while end + 1 < n and ys[end + 1] <= ys[low] + margin:
            end += 1  # still down
        return _after_bin(xs, end + 1, width), "memory was given back"
    knee = _fill_end(xs, ys)
    if knee is not None:
        return _after_bin(xs, knee, width), "the floor levelled off"
    return None


def _after_bin(xs: list[float], k: int, width: float) -> float:
    """Where bin `k` (centred at xs[k]) ends: past the last bin, the newest time it can be."""
    return xs[-1] + width / 2 if k + 1 >= len(xs) else (xs[k] + xs[k + 1]) / 2


def _fill_end(xs: list[float], ys: list[float]) -> int | None:
    """The first bin after a rise that stopped in the first half (a line up to a knee, flat
    after it), where that fits clearly better than one line: by `F_FILL` as for a break."""
    n = len(xs)
    best, best_gain, best_sse = _best_knee(xs, ys)
    if best is None or best_gain < n * MIN_BREAK_SHIFT_BYTES**2:
        return None
    scale = max(abs(y) for y in ys) or 1.0
    residual = max(best_sse, 1e-12 * scale * scale) / (n - 3)
    return best if best_gain / residual >= F_FILL else None


def _best_knee(xs: list[float], ys: list[float]) -> tuple[int | None, float, float]:
    """Of the knees in the first half, the one whose rising line (x held at the knee after it)
    rises and gains most over one line: (its bin, the gain in squared residuals, its own sum of
    squared residuals); (None, 0.0, 0.0) where none gains.

    Each candidate's line is fitted once, and y less its mean worked out once for them all: the
    same operations in the same order as `_residuals_on` (the same bits).  This loop is O(n²)
    and fitted each candidate twice (its slope, then its residuals): it was most of a verdict
    without steps, which the dashboard works out for every such agent device every
    LEAK_REFRESH_S."""
    n = len(xs)
    sse_line = sum(r * r for r in _residuals_on(xs, ys))
    best, best_gain, best_sse = None, 0.0, 0.0
    my = sum(ys) / n
    yc = [y - my for y in ys]
    for k in range(1, n // 2 + 1):
        knee = xs[k]
        rising = [min(x, knee) for x in xs]
        mx = sum(rising) / n
        xc = [x - mx for x in rising]
        sxx = sum(c**2 for c in xc)
        slope = sum(map(mul, xc, yc)) / sxx if sxx else 0.0
        if slope <= 0:
            continue
        residuals = [d - slope * c for c, d in zip(xc, yc, strict=True)]
        sse = sum(map(mul, residuals, residuals))
        if sse_line - sse > best_gain:
            best, best_gain, best_sse = k, sse_line - sse, sse
    return best, best_gain, best_sse


def _window_minima(
    times: Sequence[float], values: Sequence[float], windows: int
) -> tuple[list[float], list[float]]:
    """The lowest sample of each of `windows` windows of equal sample counts, at its own time."""
    n = len(times)
    xs, ys = [], []
    for k in range(windows):
        lo, hi = k * n // windows, (k + 1) * n // windows
        j = min(range(lo, hi), key=values.__getitem__)
        xs.append(times[j])
        ys.append(values[j])
    return xs, ys


def _sen_interval(xs: Sequence[float], ys: Sequence[float], z: float) -> tuple[float, float]:
    """Sen's (1968) distribution-free confidence interval of the Theil–Sen slope: the pairwise
    slopes ranked (N - C)/2 and (N + C)/2, C = z × the Mann–Kendall statistic's deviation."""
    slopes = sorted(
        (ys[j] - ys[i]) / (xs[j] - xs[i])
        for i in range(len(xs))
        for j in range(i + 1, len(xs))
        if xs[j] != xs[i]
    )
    count = len(slopes)
    if not count:
        return 0.0, 0.0
    n = len(xs)
    c = z * math.sqrt(n * (n - 1) * (2 * n + 5) / 18)
    lower = max(0, min(count - 1, int((count - c) / 2)))
    upper = max(0, min(count - 1, math.ceil((count + c) / 2)))
    return slopes[lower], slopes[upper]


def _lower_hull(xs: Sequence[float], ys: Sequence[float]) -> list[tuple[float, float]]:
    """The lower convex hull of the points (xs increasing), left to right (monotone chain)."""
    hull: list[tuple[float, float]] = []
    for x, y in zip(xs, ys, strict=True):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (y - y1) - (y2 - y1) * (x - x1) <= 0:
                hull.pop()  # the middle point lies on or above the chord
            else:
                break
        hull.append((x, y))
    return hull


def _hull_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """The slope of the lower hull's edge under the points' middle time: the line under every
    sample that hugs them best (the least sum of gaps), i.e. the floor a sawtooth rides on."""
    hull = _lower_hull(xs, ys)
    if len(hull) < 2:
        return None
    middle = (xs[0] + xs[-1]) / 2
    for (x1, y1), (x2, y2) in itertools.pairwise(hull):
        if x2 >= middle and x2 > x1:
            return (y2 - y1) / (x2 - x1)
    return None


def _replace_reason(estimate: LeakEstimate, reason: str) -> LeakEstimate:
    values = {name: getattr(estimate, name) for name in LeakEstimate.__slots__}
    values["reason"] = reason
    return LeakEstimate(**values)


# ------------------------------------------------------------------------------ the test


@record(frozen=True, slots=True)
class _Trend:
    """The leak test's fit of one regime's binned floor: its slope, how sure, and how noisy."""

    xs: list[float]  # the bins of the analysed regime
    ys: list[float]
    slope: float
    z: float
    recent_z: float
    recent_slope: float
    step_like: bool  # one jump in level explains it as well as a slope
    noise: float  # robust spread of the bins around the trend line

    @property
    def confidence(self) -> float:
        if self.slope <= 0:
            return 0.0
        return _one_sided_confidence(self.z)


def _analyse(
    raw_x: Sequence[float],
    raw_y: Sequence[float],
    reduce: Callable[[Sequence[float], Sequence[float]], tuple[list[float], list[float]]],
    min_raw: int,
) -> tuple[int, _Trend | None]:
    """Cut off everything before the newest regime change, then measure the trend.

    Returns the index of the regime's first raw point, and its trend (None when the regime is
    too short to judge yet).  After each cut the regime is binned again from the raw points, so
    a short regime keeps its resolution.
    """
    first = 0
    xs, ys = reduce(raw_x, raw_y)
    breaks = None  # the breaks of the current xs, ys once looked for
    for _ in range(MAX_BREAKS):
        breaks = _find_breaks(xs, ys)
        cut = _regime_change(breaks, ys)
        if cut is None:
            break
        boundary = (xs[cut - 1] + xs[cut]) / 2
        first = max(first, _first_index_at_or_after(raw_x, boundary))
        if len(raw_x) - first < min_raw:
            return first, None
        xs, ys = reduce(raw_x[first:], raw_y[first:])
        breaks = None
    if breaks is None:
        breaks = _find_breaks(xs, ys)
    if len(xs) < MIN_BINS:
        return first, None
    recent = max(5, len(xs) // 3)
    rx, ry = xs[-recent:], ys[-recent:]
    slope = _theil_sen(xs, ys)
    return first, _Trend(
        xs=xs,
        ys=ys,
        slope=slope,
        z=_mann_kendall_z(ys, _autocorrelation_inflation(xs, ys, slope)),
        recent_z=_mann_kendall_z(ry),
        recent_slope=_theil_sen(rx, ry),
        step_like=_a_jump_fits_as_well(breaks, ys),
        noise=_robust_spread(xs, ys, slope),
    )


def _verdict(trend: _Trend, growth: float, unit: str) -> tuple[bool, str]:
    if trend.slope <= 0 or trend.z < Z_TREND:
        return False, "no significant growth of the baseline"
    if trend.step_like:
        return False, "one step up in level, not a steady climb (yet)"
    if trend.recent_slope <= 0:
        return False, "grew earlier, flat lately (warm-up or a plateau)"
    if growth < NOISE_MULTIPLE * trend.noise:
        return False, "a slight rise, still within the noise"
    if growth < MIN_GROWTH_BYTES:
        return False, f"grows, but only {growth / 1024:.0f} KiB so far"
    return True, f"baseline grows {trend.slope / MiB:.2f} MiB per {unit}"


def _persists(steps: Sequence[float], allocated: Sequence[float], reason: str) -> tuple[bool, str]:
    """A climb not far above the baseline's spread: is it a leak or a wander?  The regime's
    marks are judged again as medians of `MEMORY_STEPS` steps each, so a baseline that
    remembers a few steps is not counted as many independent points; the climb must be
    significant on those, and still climbing in their newer half (a leak grows without bound,
    a wander or a saturating rise levels off).

    Why: Mann–Kendall on single marks cannot tell a trend from a wander that lasts a third of
    the window, and the lag-1 correction cannot either when the window holds a few wanders
    only (the detrended marks of such a window look independent).  On a loaded box every step
    is marked, and the fragment demo's baseline (a moving sum of 8 steps' buffers, σ 7 MiB)
    read as a leak of 0.2-1.2 MiB per step in 18 of 99 seeds within 100 steps."""
    needed = MIN_BINS * MEMORY_STEPS
    if len(steps) < needed:
        return False, f"a slight rise; {len(steps)} of {needed} steps to tell it from a wander"
    xs, ys = _bin_medians(steps, allocated, min(MAX_BINS, len(steps) // MEMORY_STEPS))
    slope = _theil_sen(xs, ys)
    if slope <= 0 or _mann_kendall_z(ys, _autocorrelation_inflation(xs, ys, slope)) < Z_PERSIST:
        return False, f"a rise over a few steps at a time, not a steady climb (over {needed} steps)"
    newer = len(xs) // 2
    if _theil_sen(xs[newer:], ys[newer:]) < slope / 2:
        return False, "grew earlier, levelling off lately"
    return True, reason


@record(frozen=True, slots=True)
class _Breaks:
    """The best single break of each kind added to a line, from one pass over the bins."""

    sse_line: float
    jump_at: int | None  # a step in level from this bin on
    jump_gain: float  # how much SSE the jump removes from the line's
    bend_at: int | None  # a change of slope from this bin on
    bend_gain: float


def _regime_change(breaks: _Breaks, ys: list[float]) -> int | None:
    """Index where the series changes regime, when a line with a break there fits much better
    than one line: a jump in level (a bigger batch from now on, an OOM restart) or a bend in
    slope (a warm-up ramp that levelled off, a leak that started)."""
    if breaks.bend_gain > breaks.jump_gain:
        k, gain = breaks.bend_at, breaks.bend_gain
    else:
        k, gain = breaks.jump_at, breaks.jump_gain
    if k is None or gain < len(ys) * MIN_BREAK_SHIFT_BYTES**2:
        return None
    scale = max(abs(y) for y in ys) or 1.0
    sse_break = max(breaks.sse_line - gain, 1e-12 * scale * scale)
    return k if gain / (sse_break / (len(ys) - 3)) >= F_BREAK else None


def _a_jump_fits_as_well(breaks: _Breaks, ys: list[float]) -> bool:
    """True when one step in level explains the series at least as well as a steady slope:
    a small level shift in noise looks like a slow trend, and is not called a leak until the
    slope wins."""
    if breaks.jump_at is None:
        return False
    # The jump alone (two flat levels) against the line: the slope's share is unexplained.
    return _sse_of_step_at(ys, breaks.jump_at) <= breaks.sse_line


def _sse_of_step_at(ys: list[float], k: int) -> float:
    left, right = ys[:k], ys[k:]
    ml, mr = sum(left) / len(left), sum(right) / len(right)
    return sum((y - ml) ** 2 for y in left) + sum((y - mr) ** 2 for y in right)


def _find_breaks(xs: list[float], ys: list[float]) -> _Breaks:
    """Each break adds one regressor to the line; by Frisch–Waugh, with y and the regressor
    residualised on x, its fit is a one-variable regression, so every candidate costs O(n)."""
    n = len(xs)
    ry = _residuals_on(xs, ys)
    sse_line = sum(r * r for r in ry)
    scale = max(abs(y) for y in ys) or 1.0
    if n < 8 or sse_line <= n * (1e-9 * scale) ** 2:
        # A line already explains it (a noiseless leak, a flat run).
        return _Breaks(sse_line, None, 0.0, None, 0.0)
    best: dict[str, tuple[int | None, float]] = {"jump": (None, 0.0), "bend": (None, 0.0)}
    # x's mean and spread are the same for every candidate: worked out once here, not twice
    # per candidate (the same operations in the same order as _residuals_on: the same bits).
    mx = sum(xs) / n
    xc = [x - mx for x in xs]
    sxx = sum(c**2 for c in xc)
    # Bin medians of marks whose steps ascend (nearly always): the rows below each knee are a
    # first run, so each candidate's regressors, less their means, are made of runs (C-speed
    # list repeats) rather than a Python line per row: the same values (`_centred_regressors`).
    ascending = all(map(le, xs, xs[1:]))  # False with a NaN
    for k in range(2, n - 2):
        jump, bend = _centred_regressors(xs, k, ascending)
        for kind, centred in (("jump", jump), ("bend", bend)):
            rd = _residuals_of_centred(xc, sxx, centred)
            # map(mul, …) rather than generators: the same products summed in the same order
            # (the same bits), without a generator frame per term; this loop is O(n²) and runs
            # on the dashboard's thread for every agent device every LEAK_REFRESH_S.
            sdd = sum(map(mul, rd, rd))
            if sdd <= 0:
                continue
            sdy = sum(map(mul, rd, ry))
            gain = sdy * sdy / sdd
            if gain > best[kind][1]:
                best[kind] = (k, gain)
    return _Breaks(sse_line, best["jump"][0], best["jump"][1], best["bend"][0], best["bend"][1])


def _residuals_on(xs: Sequence[float], ys: Sequence[float]) -> list[float]:
    n = len(xs)
    mx = sum(xs) / n
    my = sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return [y - my - b * (x - mx) for x, y in zip(xs, ys, strict=True)]


def _residuals_of_centred(xc: Sequence[float], sxx: float, centred: Sequence[float]) -> list[float]:
    """_residuals_on, given x already centred (xc = x - mean) and its sum of squares, and y
    less its mean (`centred`, each y - my): the same operations, `y - my - b * c` being
    (y - my) - b * c."""
    b = sum(map(mul, xc, centred)) / sxx if sxx else 0.0  # c * (y - my), summed
    return [d - b * c for c, d in zip(xc, centred, strict=True)]


def _centred_regressors(
    xs: list[float], k: int, ascending: bool
) -> tuple[list[float], list[float]]:
    """The two regressors of the break candidate at bin k, each less its mean, as
    `_residuals_on` centres them: a jump (0.0 where x < xs[k], else 1.0) and a bend
    (max(0.0, x - xs[k])).  With `ascending` x the rows under the knee are a first run, made
    once and repeated: the same numbers, the same bits (a sum of 0.0s and 1.0s is their
    count exactly; 0.0 - mean is made as each row makes it)."""
    n = len(xs)
    knee = xs[k]
    if not ascending:
        jump = [0.0 if x < knee else 1.0 for x in xs]
        bend = [d if (d := x - knee) > 0.0 else 0.0 for x in xs]  # max(0.0, x - knee)
        my_jump, my_bend = sum(jump) / n, sum(bend) / n
        return [y - my_jump for y in jump], [y - my_bend for y in bend]
    below = bisect.bisect_left(xs, knee)  # the rows with x < knee
    my_jump = sum([0.0] * below + [1.0] * (n - below)) / n
    flat = bisect.bisect_right(xs, knee)  # the rows with x <= knee: x - knee <= 0.0
    rising = [x - knee for x in xs[flat:]]
    my_bend = sum([0.0] * flat + rising) / n
    return (
        [0.0 - my_jump] * below + [1.0 - my_jump] * (n - below),
        [0.0 - my_bend] * flat + [d - my_bend for d in rising],
    )


def _robust_spread(xs: Sequence[float], ys: Sequence[float], slope: float) -> float:
    """1.4826 × the median absolute deviation around the Theil–Sen line (σ for Gaussian noise)."""
    intercept = median(y - slope * x for x, y in zip(xs, ys, strict=True))
    return 1.4826 * median(abs(y - slope * x - intercept) for x, y in zip(xs, ys, strict=True))


def _theil_sen(xs: Sequence[float], ys: Sequence[float]) -> float:
    slopes = [
        (ys[j] - ys[i]) / (xs[j] - xs[i])
        for i in range(len(xs))
        for j in range(i + 1, len(xs))
        if xs[j] != xs[i]
    ]
    return median(slopes) if slopes else 0.0


def _mann_kendall_z(ys: Sequence[float], inflation: float = 1.0) -> float:
    """The Mann–Kendall trend statistic as a z-score (ties corrected), its variance multiplied
    by `inflation` (`_autocorrelation_inflation`)."""
    n = len(ys)
    if n < 3:
        return 0.0
    s = _kendall_s(ys)
    ties: dict[float, int] = {}
    for y in ys:
        ties[y] = ties.get(y, 0) + 1
    variance = (
        n * (n - 1) * (2 * n + 5) - sum(t * (t - 1) * (2 * t + 5) for t in ties.values())
    ) / 18
    variance *= inflation
    if variance <= 0 or s == 0:
        return 0.0
    return (s - 1 if s > 0 else s + 1) / math.sqrt(variance)


def _kendall_s(ys: Sequence[float]) -> int:
    """Mann–Kendall's S: over every pair i < j, +1 where y_j > y_i, −1 where y_j < y_i (ties
    count 0).  Each point is compared with the later ones kept sorted, by bisection: two C
    calls a point, not a Python line a pair (this runs two or three times per leak verdict,
    on the dashboard's thread).  The same integer; a NaN, which compares false with
    everything and so breaks the sorted order, is counted pair by pair."""
    if any(map(math.isnan, ys)):
        s = 0
        for i, yi in enumerate(ys):
            for yj in ys[i + 1 :]:
                if yj > yi:
                    s += 1
                elif yj < yi:
                    s -= 1
        return s
    later: list[float] = []  # the points after i, sorted
    s = 0
    for yi in reversed(ys):
        # later points above yi, less later points below it
        s += len(later) - bisect.bisect_right(later, yi) - bisect.bisect_left(later, yi)
        bisect.insort(later, yi)
    return s


def _autocorrelation_inflation(xs: Sequence[float], ys: Sequence[float], slope: float) -> float:
    """How much wider the Mann–Kendall variance is for these points than for independent ones:
    Yue & Wang's (2004) n/n*, from the lag-1 autocorrelation of the detrended ranks when it is
    significant (1 otherwise, and for a negative one: that does not make the test bolder).

    Why: Mann–Kendall assumes independent points.  A baseline that holds a few steps' buffers
    (an EMA, metrics kept for k steps, the fragment demo's per-layer outputs kept 8 steps) is a
    moving sum: consecutive marks share most of it (lag-1 correlation 0.85).  A busy box slows
    the steps, the 20-per-second mark limit stops thinning them, every step is marked, and a
    wander over a few steps, read as 40 independent bins, passed z 3.09 in 4 of 6 runs: a leak
    alarm that came and went on a trainer that does not leak.  Lag 1 alone, extrapolated as
    ρᵏ: over 30 to 40 bins the higher lags' own estimates are too noisy and biased low."""
    n = len(ys)
    if n < 4:
        return 1.0
    ranks = _ranks([y - slope * x for x, y in zip(xs, ys, strict=True)])
    mean = (n - 1) / 2
    centred = [r - mean for r in ranks]
    energy = sum(c * c for c in centred)
    if energy <= 0:
        return 1.0
    rho = sum(centred[t] * centred[t + 1] for t in range(n - 1)) / energy
    if rho <= 1.96 / math.sqrt(n):  # within the noise of independent points (5 %)
        return 1.0
    return 1.0 + 2.0 / n * sum((n - k) * rho**k for k in range(1, n))


def _ranks(values: Sequence[float]) -> list[float]:
    """0-based ranks, tied values sharing their mean rank."""
    n = len(values)
    order = sorted(range(n), key=values.__getitem__)
    ranks = [0.0] * n
    i = 0
    while i < n:
        j = i
        while j + 1 < n and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def _one_sided_confidence(z: float) -> float:
    return 1.0 - 0.5 * math.erfc(z / math.sqrt(2))


# ------------------------------------------------------------------------------ reduction


def _bin_medians(
    xs: Sequence[float], ys: Sequence[float], max_bins: int
) -> tuple[list[float], list[float]]:
    """Equal-count bins, each reduced to its median x and median y (robust to spikes)."""
    n = len(xs)
    if n <= max_bins:
        return list(xs), list(ys)
    bx, by = [], []
    for b in range(max_bins):
        lo, hi = b * n // max_bins, (b + 1) * n // max_bins
        bx.append(median(xs[lo:hi]))
        by.append(median(ys[lo:hi]))
    return bx, by


def _rolling_minimum(
    times: Sequence[float], values: Sequence[float], window: float
) -> tuple[list[float], list[float]]:
    """Minimum per window of `window` seconds, placed at the window's centre; empty windows
    (samples missed) are skipped."""
    start = times[0]
    bins: dict[int, float] = {}
    for t, v in zip(times, values, strict=True):
        key = int((t - start) // window)
        if key not in bins or v < bins[key]:
            bins[key] = v
    keys = sorted(bins)
    # The newest window is usually partial; its minimum is biased up, so it waits.
    if len(keys) > 1 and times[-1] - (start + keys[-1] * window) < window:
        keys = keys[:-1]
    return [start + (k + 0.5) * window for k in keys], [bins[k] for k in keys]


def _first_index_at_or_after(xs: Sequence[float], x: float) -> int:
    lo, hi = 0, len(xs)
    while lo < hi:
        mid = (lo + hi) // 2
        if xs[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return min(lo, len(xs) - 1)


def leak_label(
    per_step: float | None, per_second: float | None, to_full: float | None, short: bool = False
) -> str:
    """A leak's rate in a few words: "+8.0 MiB/step · full in 7 min", or "+8.0M/step 7 min"
    where room is short (the process table, a GPU card's trend, the detail screen)."""
    size = short_bytes if short else format_bytes
    if per_step is not None:
        rate = f"+{size(int(per_step))}/step"
    elif per_second is not None:
        rate = f"+{size(int(per_second))}/s"
    else:
        rate = "growing"
    if to_full is None:
        return rate
    if short:
        return f"{rate} {format_duration(to_full)}"
    return f"{rate} · full in {format_duration(to_full)}"
