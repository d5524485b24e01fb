"""What an action did: the window of history before it against the window after (issue 34).

For each action memtop performed in a trainer (memtop.model.ActionRecord), the same figures over
the EFFECT_WINDOW_S before and after it: reserved and split bytes (the medians of the samples:
a step's swing is not an effect), allocator retries per minute, and the step time's median
from the step marks.  The after-window grows until it is as long as the before-window; both say
how many samples and seconds they hold, so a figure from three samples reads as such.

An action known from the agent's action log (another shell's `memtop cleanup`, another viewer)
may predate this viewer's history: then the before-window is the agent's own reading of the
counters right before the action (`basis` "agent", no samples, no rate), with the step time
from the step marks, which reach back further.  A refused action changed nothing: no windows.
Pure: arrays in, a record out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memtop.base.records import record
from memtop.figures.median import median
from memtop.model import ACTION_BY_VIEWER, ActionRecord, search_column

EFFECT_WINDOW_S = 60.0
BASIS_SAMPLES = "samples"
BASIS_AGENT = "agent"


@record(frozen=True, slots=True)
class Window:
    """The figures of one window of a device's history."""

    seconds: float
    samples: int
    reserved_bytes: int | None
    split_bytes: int | None  # free bytes inside split segments (inactive_split_bytes)
    retries_per_min: float | None
    step_time_s: float | None  # the median of the step marks' durations
    # The standard error of that median (1.253 σ / √n, σ from the MAD): its noise.
    step_time_se_s: float | None = None
    # BASIS_SAMPLES: this viewer's samples; BASIS_AGENT: the agent's reading right before the
    # action (a viewer that connected after it), one reading, no rate.
    basis: str = "samples"

    def as_json(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 1),
            "samples": self.samples,
            "reserved_bytes": self.reserved_bytes,
            "split_bytes": self.split_bytes,
            "retries_per_min": (
                None if self.retries_per_min is None else round(self.retries_per_min, 2)
            ),
            "step_time_s": None if self.step_time_s is None else round(self.step_time_s, 6),
            "step_time_se_s": (
                None if self.step_time_se_s is None else round(self.step_time_se_s, 6)
            ),
            "basis": self.basis,
        }


@record(frozen=True, slots=True)
class ActionEffect:
    """One action on one device of its trainer: the windows before and after it."""

    action: ActionRecord
    device: int | None  # None: the trainer uses no device memtop measures (a CPU trainer)
    before: Window | None  # None: no sample in that window
    after: Window | None

    def step_time_change(self) -> tuple[float, float] | None:
        """The step time's change in % of before, and its noise (two standard errors of the
        difference of the medians, in %): "+0.4 % ± 0.6 %" is no change beyond noise."""
        b, a = self.before, self.after
        if b is None or a is None or not b.step_time_s or a.step_time_s is None:
            return None
        if b.step_time_se_s is None or a.step_time_se_s is None:
            return None
        change = 100.0 * (a.step_time_s - b.step_time_s) / b.step_time_s
        noise = 200.0 * (b.step_time_se_s**2 + a.step_time_se_s**2) ** 0.5 / b.step_time_s
        return change, noise

    def as_json(self) -> dict[str, Any]:
        change = self.step_time_change()
        action = self.action
        return {
            "kind": action.kind,
            "time": action.time,
            "pid": action.pid,
            "args": dict(action.args),
            # Who asked (the agent's log: the client's uid and pid; null uid: the agent itself),
            # whether it ran, and the step it ran after.
            "by": {"uid": action.by_uid, "pid": action.by_pid},
            "by_this_memtop": action.source == ACTION_BY_VIEWER,
            "result": action.result,
            "why": action.why,
            "step": action.step,
            "device": self.device,
            "before": self.before.as_json() if self.before is not None else None,
            "after": self.after.as_json() if self.after is not None else None,
            "step_time_change_pct": None if change is None else round(change[0], 2),
            "step_time_noise_pct": None if change is None else round(change[1], 2),
        }


def window(
    times: Sequence[float],
    reserved: Sequence[float],
    split: Sequence[float],
    retries: Sequence[float],
    mark_steps: Sequence[float],
    mark_times: Sequence[float],
    start: float,
    end: float,
) -> Window | None:
    """The figures of the samples with start < time <= end (None without one)."""
    first, last = search_column(times, start, True), search_column(times, end, True)
    if last <= first:
        return None
    span = times[last - 1] - times[first]
    counted = retries[first:last]
    per_min = None
    if span > 0 and len(counted) >= 2:
        per_min = max(0.0, counted[-1] - counted[0]) * 60.0 / span
    step_time, step_time_se = _step_time(mark_steps, mark_times, start, end)
    return Window(
        seconds=span,
        samples=last - first,
        reserved_bytes=int(median(reserved[first:last])),
        split_bytes=int(median(split[first:last])) if len(split) >= last else None,
        retries_per_min=per_min,
        step_time_s=step_time,
        step_time_se_s=step_time_se,
    )


def _step_time(
    steps: Sequence[float], times: Sequence[float], start: float, end: float
) -> tuple[float | None, float | None]:
    """The median duration of a step between consecutive marks in (start, end], and the
    standard error of that median."""
    first, last = search_column(times, start, True), search_column(times, end, True)
    durations = [
        (times[i] - times[i - 1]) / (steps[i] - steps[i - 1])
        for i in range(max(first, 1), last)
        if steps[i] > steps[i - 1] and times[i - 1] > start
    ]
    if not durations:
        return None, None
    middle = median(durations)
    se = None
    if len(durations) >= 3:
        spread = 1.4826 * median(abs(d - middle) for d in durations)
        se = 1.253 * spread / len(durations) ** 0.5
    return middle, se


def effect(
    action: ActionRecord,
    device: int,
    times: Sequence[float],
    reserved: Sequence[float],
    split: Sequence[float],
    retries: Sequence[float],
    mark_steps: Sequence[float],
    mark_times: Sequence[float],
    window_s: float = EFFECT_WINDOW_S,
) -> ActionEffect:
    """The windows of `window_s` before and after `action` of one device's history."""
    if not action.ok:
        return ActionEffect(action, device, None, None)
    at = action.time
    columns = (times, reserved, split, retries, mark_steps, mark_times)
    before = window(*columns, at - window_s, at)
    reading = action.before.get(device)
    if before is None and reading is not None:
        step_time, step_time_se = _step_time(mark_steps, mark_times, at - window_s, at)
        before = Window(
            seconds=0.0,
            samples=0,
            reserved_bytes=reading.get("reserved_bytes"),
            split_bytes=reading.get("split_bytes"),
            retries_per_min=None,
            step_time_s=step_time,
            step_time_se_s=step_time_se,
            basis=BASIS_AGENT,
        )
    return ActionEffect(action, device, before, window(*columns, at, at + window_s))
