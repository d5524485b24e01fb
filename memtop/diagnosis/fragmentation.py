"""Fragmentation and allocator pressure of one agent device (DESIGN §4).

- the gauge: inactive split bytes of the large pool over its reserved bytes.  It swings within a
  step (a freed activation splits a segment until the next one reuses it), so the value judged
  is the median of the recent samples;
- from the agent's low-rate trace-free snapshot (memtop.figures.segments): the bytes a split
  strands (free blocks inside large-pool segments that also hold live blocks), their share of
  the large pool (the "external fragmentation"), and the largest request the cache can serve
  without a new cudaMalloc.  Whole free cached segments are not fragmentation: any request up
  to their size reuses them;
- internal fragmentation: allocated − requested bytes (the allocator's rounding);
- pressure: how many free-the-cache-and-retry rounds and OOMs the allocator went through, in
  total and over the recent window.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from memtop.base.records import record
from memtop.figures.median import median
from memtop.model import AgentDeviceSample

GAUGE_SAMPLES = 10  # the gauge judged is the median of this many recent samples
PRESSURE_WINDOW_S = 600.0  # "recent" retries and OOMs: the last 10 minutes
MIN_PRESSURE_WINDOW_S = 30.0  # with less history than this, judge the totals instead


@record(frozen=True, slots=True)
class Fragmentation:
    """How fragmented one device's caching allocator is: the gauge, its median and the bytes
    behind it."""

    gauge: float  # latest sample
    gauge_smoothed: float  # median of the recent samples: the value rules judge
    inactive_split_bytes: int
    reserved_large_bytes: int
    external: float | None  # stranded / reserved large pool, from the latest snapshot summary
    largest_free_block_bytes: int | None  # the largest request the cache serves as it is
    external_age_s: float | None
    internal_bytes: int | None  # allocated − requested, None when torch does not report it
    stranded_bytes: int | None = None  # free inside segments that hold live blocks (snapshot)
    # How many readings `gauge_smoothed` is the median of: with one or two it is still a
    # mid-step reading (the gauge swings within a step), not a judgement.
    samples: int = 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "gauge": round(self.gauge, 4),
            "gauge_smoothed": round(self.gauge_smoothed, 4),
            "inactive_split_bytes": self.inactive_split_bytes,
            "reserved_large_bytes": self.reserved_large_bytes,
            "external": None if self.external is None else round(self.external, 4),
            "largest_free_block_bytes": self.largest_free_block_bytes,
            "external_age_s": (
                None if self.external_age_s is None else round(self.external_age_s, 1)
            ),
            "internal_bytes": self.internal_bytes,
            "stranded_bytes": self.stranded_bytes,
            "samples": self.samples,
        }


@record(frozen=True, slots=True)
class Pressure:
    """One device's allocation retries and OOMs: since the trainer started and recently."""

    retries: int  # since the trainer started (torch's cumulative counters)
    ooms: int
    retries_recent: int | None  # over the last `window_s` of history; None with too little
    ooms_recent: int | None
    window_s: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_alloc_retries": self.retries,
            "num_ooms": self.ooms,
            "retries_recent": self.retries_recent,
            "ooms_recent": self.ooms_recent,
            "window_s": None if self.window_s is None else round(self.window_s, 1),
        }


def _stat(stats: Mapping[str, int], key: str) -> int | None:
    value = stats.get(key)
    return int(value) if isinstance(value, int | float) else None


# `snapshot_figures` of one snapshot summary: (external, largest request, stranded bytes).
SnapshotFigures = tuple[float | None, int | None, int | None]


def fragmentation(
    latest: AgentDeviceSample,
    gauge_history: Sequence[float],
    snapshot: Mapping[str, Any] | None,
    snapshot_age_s: float | None,
    figures: SnapshotFigures | None = None,
) -> Fragmentation:
    """`figures`: `snapshot_figures(snapshot)` where the caller kept them (a summary is read
    once a snapshot interval and judged every round)."""
    recent = list(gauge_history[-GAUGE_SAMPLES:]) or [latest.fragmentation]
    allocated = _stat(latest.stats, "allocated_bytes.all.current")
    requested = _stat(latest.stats, "requested_bytes.all.current")
    internal = (
        max(0, allocated - requested) if allocated is not None and requested is not None else None
    )
    external = largest = stranded = None
    if snapshot is not None:
        external, largest, stranded = figures or snapshot_figures(snapshot)
    return Fragmentation(
        gauge=latest.fragmentation,
        gauge_smoothed=median(recent),
        inactive_split_bytes=_stat(latest.stats, "inactive_split_bytes.large_pool.current") or 0,
        reserved_large_bytes=_stat(latest.stats, "reserved_bytes.large_pool.current") or 0,
        external=external,
        largest_free_block_bytes=largest,
        external_age_s=snapshot_age_s if snapshot is not None else None,
        internal_bytes=internal,
        stranded_bytes=stranded,
        samples=len(recent),
    )


def snapshot_figures(summary: Mapping[str, Any]) -> SnapshotFigures:
    """(external fragmentation, largest request served from the cache, stranded bytes) of one
    device's snapshot summary, from whichever fields it has: an agent that sends the figures of
    `summarize_segments` gives the exact ones; an older summary (inactive bytes of the large
    pool and its largest block) gives the largest block, but no stranded figure, since it
    cannot tell a stranded block from a wholly free segment."""

    def number(key: str) -> int | None:
        value = summary.get(key)
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

    stranded = number("stranded_bytes")
    largest = number("largest_request_bytes")
    if largest is None:
        largest = number("largest_inactive_large_bytes")
    reserved_large = number("reserved_large_bytes")
    external: float | None = None
    if stranded is not None and reserved_large is not None:
        external = stranded / reserved_large if reserved_large > 0 else 0.0
    return external, largest, stranded


def pressure(
    latest: AgentDeviceSample,
    times: Sequence[float],
    retries: Sequence[float],
    ooms: Sequence[float],
    window_s: float = PRESSURE_WINDOW_S,
) -> Pressure:
    """Deltas over the window; a counter that went down (reset_peak_memory_stats resets it, or
    the trainer restarted) counts from its new value."""
    if len(times) < 2 or times[-1] - times[0] < MIN_PRESSURE_WINDOW_S:
        return Pressure(latest.num_alloc_retries, latest.num_ooms, None, None, None)
    # The first row within the window (times ascend): a bisection, not a walk back through
    # ten minutes of rows for every device every round.
    start = min(bisect.bisect_left(times, times[-1] - window_s), len(times) - 1)
    return Pressure(
        latest.num_alloc_retries,
        latest.num_ooms,
        _increase(retries[start:]),
        _increase(ooms[start:]),
        times[-1] - times[start],
    )


def _increase(values: Sequence[float]) -> int:
    if not values:
        return 0
    # Most counters did not move over the window (no retry, no OOM): told at C speed, without
    # listing and sorting the window's rows for every device every round.
    first = values[0]
    if values[-1] == first and values.count(first) == len(values):
        return 0
    # A counter that never went down (nearly always: it only resets with the peak stats)
    # increased by last − first; telling so takes C-speed passes, not a Python loop per row.
    ordered = list(values)
    if ordered == sorted(ordered):
        return int(ordered[-1] - ordered[0])
    total = 0.0
    for before, after in itertools.pairwise(values):
        total += after - before if after >= before else after
    return int(total)
