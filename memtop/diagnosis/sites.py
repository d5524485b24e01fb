"""Which line holds the memory: the agent's `sites` readings judged per site (issue 23).

Each reading groups one agent's live blocks by the user's line that allocated them (bytes,
blocks, and old blocks: alive at the agent's previous reading).  Over the readings the viewer
kept, each site of a device gets a trend - bytes per step from its first reading to its newest.

The leak's line: the process's own leak verdict (memtop.diagnosis.leak, on the per-step
baselines) says *whether* memory leaks; the site says *where*.  A site is the leak's when its
bytes grow from reading to reading (never falling back) by at least LEAK_SHARE of the process's
leak rate, with blocks that outlive the readings (old blocks), and more than any other site.
Only a detected process leak is attributed: a site's own few readings are no statistics.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from memtop.base.records import record
from memtop.diagnosis.leak import LeakEstimate
from memtop.model import AgentSites, Site

MIN_READINGS = 3  # readings of a site before it has a trend
LEAK_SHARE = 0.25  # a leak's site grows by at least this share of the process's leak rate
MAX_FALLS = 0  # readings at which a leaking site's bytes went down


@record(frozen=True, slots=True)
class SiteTrend:
    """One site of one device, as the newest reading has it, with its trend."""

    site: Site
    bytes: int
    blocks: int
    old_blocks: int
    bytes_per_step: float | None  # None: too few readings, or no steps between them
    since_step: int | None  # the step of its first reading
    leaking: bool = False

    def as_dict(self) -> dict[str, object]:
        return {
            "site": {
                "file": self.site.file,
                "line": self.site.line,
                "function": self.site.function,
                "text": self.site.text,
            },
            "bytes": self.bytes,
            "blocks": self.blocks,
            "old_blocks": self.old_blocks,
            "bytes_per_step": (
                round(self.bytes_per_step, 1) if self.bytes_per_step is not None else None
            ),
            "since_step": self.since_step,
            "leaking": self.leaking,
        }


def _key(site: Site) -> tuple[str, int, str]:
    return (site.file, site.line, site.function)


def site_trends(
    readings: Sequence[AgentSites], device: int, leak: LeakEstimate | None = None
) -> tuple[SiteTrend, ...]:
    """The sites of `device` in the newest reading, each with its trend: the one the process's
    detected leak comes from first (marked `leaking`), then the largest first."""
    mine = [r for r in readings if r.enabled and r.step is not None]
    if not mine:
        return ()
    newest = mine[-1]
    series: dict[tuple[str, int, str], list[tuple[int, int]]] = {}
    for reading in mine:
        assert reading.step is not None
        for usage in reading.sites:
            if usage.device == device:
                series.setdefault(_key(usage.site), []).append((reading.step, usage.bytes))
    trends = []
    for usage in sorted((u for u in newest.sites if u.device == device), key=lambda u: -u.bytes):
        points = series.get(_key(usage.site), [])
        per_step = None
        since = points[0][0] if points else None
        if len(points) >= MIN_READINGS and points[-1][0] > points[0][0]:
            per_step = (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])
        trends.append(
            SiteTrend(usage.site, usage.bytes, usage.blocks, usage.old_blocks, per_step, since)
        )
    culprit = _leaking(trends, series, leak)
    if culprit is None:
        return tuple(trends)
    marked = SiteTrend(
        culprit.site,
        culprit.bytes,
        culprit.blocks,
        culprit.old_blocks,
        culprit.bytes_per_step,
        culprit.since_step,
        leaking=True,
    )
    return (marked, *(t for t in trends if t is not culprit))


def _leaking(
    trends: list[SiteTrend],
    series: dict[tuple[str, int, str], list[tuple[int, int]]],
    leak: LeakEstimate | None,
) -> SiteTrend | None:
    if leak is None or not leak.detected:
        return None
    rate = leak.bytes_per_step
    best: SiteTrend | None = None
    for trend in trends:
        if trend.bytes_per_step is None or trend.bytes_per_step <= 0 or trend.old_blocks == 0:
            continue
        points = series[_key(trend.site)]
        falls = sum(1 for (_, a), (_, b) in itertools.pairwise(points) if b < a)
        if falls > MAX_FALLS:
            continue
        if rate is not None and trend.bytes_per_step < LEAK_SHARE * rate:
            continue
        if best is None or trend.bytes_per_step > (best.bytes_per_step or 0):
            best = trend
    return best


def leaking_site(trends: Sequence[SiteTrend]) -> SiteTrend | None:
    return next((t for t in trends if t.leaking), None)
