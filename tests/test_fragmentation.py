"""Fragmentation, internal fragmentation and pressure deltas of one agent device (DESIGN §4)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from memtop.diagnosis.fragmentation import fragmentation, pressure
from memtop.figures.segments import summarize_segments
from memtop.figures.units import MiB
from memtop.model import AgentDeviceSample

H100_SNAPSHOTS = sorted(
    (Path(__file__).resolve().parents[2] / "shared" / "traces" / "cuda-h100").glob(
        "snapshot-*.pickle"
    )
)


def sample(**stats: int) -> AgentDeviceSample:
    return AgentDeviceSample(0, stats, free_bytes=0, total_bytes=0)


def test_gauge_is_judged_on_the_median_of_recent_samples():
    latest = sample(
        **{
            "inactive_split_bytes.large_pool.current": 10 * MiB,
            "reserved_bytes.large_pool.current": 100 * MiB,
        }
    )
    frag = fragmentation(latest, [0.3, 0.45, 0.1, 0.35, 0.1], None, None)
    assert frag.gauge == 0.1  # the latest reading swings within a step ...
    assert frag.gauge_smoothed == 0.3  # ... the median of the recent ones does not
    assert frag.inactive_split_bytes == 10 * MiB and frag.external is None
    assert fragmentation(latest, [], None, None).gauge_smoothed == 0.1


def test_internal_and_external_fragmentation():
    latest = sample(
        **{
            "allocated_bytes.all.current": 100 * MiB,
            "requested_bytes.all.current": 97 * MiB,
        }
    )
    summary = {
        "stranded_bytes": 30 * MiB,
        "reserved_large_bytes": 120 * MiB,
        "largest_request_bytes": 40 * MiB,
    }
    frag = fragmentation(latest, [], summary, 12.0)
    assert frag.internal_bytes == 3 * MiB
    assert frag.external == 0.25 and frag.largest_free_block_bytes == 40 * MiB
    assert frag.stranded_bytes == 30 * MiB
    assert frag.external_age_s == 12.0
    # An older agent's summary: its "external_fragmentation" counted whole free segments and is
    # not shown; its largest inactive block still is the largest request the cache can serve.
    old = {"external_fragmentation": 0.88, "largest_inactive_large_bytes": 4 * MiB}
    frag = fragmentation(latest, [], old, 12.0)
    assert frag.external is None and frag.stranded_bytes is None
    assert frag.largest_free_block_bytes == 4 * MiB
    # torch builds without requested_bytes: unknown, not zero
    assert fragmentation(sample(), [], None, None).internal_bytes is None


def test_pressure_counts_increases_in_the_window_across_a_counter_reset():
    latest = sample(num_alloc_retries=3, num_ooms=1)
    times = [0.0, 100.0, 400.0, 700.0, 800.0]
    retries = [50.0, 52.0, 60.0, 1.0, 3.0]  # reset between 400 s and 700 s
    ooms = [0.0, 0.0, 1.0, 1.0, 1.0]
    p = pressure(latest, times, retries, ooms, window_s=600)
    # the window starts at 400 s: 60 → reset → 1 (+1) → 3 (+2)
    assert p.retries_recent == 3 and p.ooms_recent == 0
    assert p.window_s == 400.0
    assert p.retries == 3 and p.ooms == 1


def test_pressure_matches_the_row_by_row_definition_on_long_windows():
    """The window is found by bisection and a counter that never fell is judged at C speed;
    on ten minutes of history, with and without resets, that is the row-by-row answer."""
    import itertools
    import random

    rng = random.Random(3)

    def increase(values: list[float]) -> int:  # every rise, and a fall counts from its value
        return int(sum(b - a if b >= a else b for a, b in itertools.pairwise(values)))

    for resets in (0, 1, 3):
        times = [float(t) for t in range(0, 1200)]
        retries, value = [], 0.0
        for _ in times:
            value += rng.choice((0, 0, 0, 1))
            retries.append(value)
        for at in rng.sample(range(700, 1200), resets):
            retries[at:] = [v - retries[at] + rng.choice((0, 1)) for v in retries[at:]]
        ooms = [0.0] * len(times)
        p = pressure(sample(), times, retries, ooms, window_s=600)
        start = next(i for i, t in enumerate(times) if times[-1] - t <= 600)
        assert p.retries_recent == increase(retries[start:]) and p.ooms_recent == 0
        assert p.window_s == times[-1] - times[start]


def test_pressure_without_enough_history_falls_back_to_the_totals():
    latest = sample(num_alloc_retries=8, num_ooms=0)
    p = pressure(latest, [0.0, 0.3], [8.0, 8.0], [0.0, 0.0])
    assert p.retries_recent is None and p.retries == 8


def _segment(blocks, segment_type="large", expandable=False, device=0):
    return {
        "device": device,
        "total_size": sum(size for size, _ in blocks),
        "segment_type": segment_type,
        "is_expandable": expandable,
        "stream": 0,
        "blocks": [{"size": size, "state": state} for size, state in blocks],
    }


def test_summary_counts_only_free_blocks_stranded_beside_live_ones():
    segments = [
        _segment([(1000 * MiB, "inactive")]),  # wholly free: reusable by any request up to it
        _segment([(8 * MiB, "active_allocated"), (6 * MiB, "inactive"), (6 * MiB, "inactive")]),
        _segment([(2 * MiB, "inactive"), (18 * MiB, "active_allocated")]),
        _segment([(100 * MiB, "active_allocated"), (50 * MiB, "inactive")], expandable=True),
        _segment([(MiB // 2, "active_allocated"), (3 * MiB // 2, "inactive")], "small"),
        _segment([(20 * MiB, "inactive"), (20 * MiB, "active_allocated")], device=1),
    ]
    summary = summarize_segments(segments)
    dev = summary["0"]
    assert dev["segments"] == 5
    assert dev["stranded_bytes"] == 14 * MiB  # not the free segment, not the expandable one
    assert dev["largest_stranded_bytes"] == 6 * MiB
    assert dev["largest_request_bytes"] == 1000 * MiB  # the free segment serves it as it is
    assert dev["reserved_large_bytes"] == (1000 + 20 + 20 + 150) * MiB
    assert dev["external_fragmentation"] == pytest.approx(14 / 1190)
    assert dev["inactive_large_bytes"] == (1000 + 14 + 50) * MiB  # the old figure, kept
    assert summary["1"]["stranded_bytes"] == 20 * MiB
    # Only the small pool has free blocks: requests up to 1 MiB are served from it.
    only_small = summarize_segments([_segment([(2 * MiB, "inactive")], "small")])
    assert only_small["0"]["largest_request_bytes"] == MiB
    assert summarize_segments([]) == {}


@pytest.mark.skipif(not H100_SNAPSHOTS, reason="shared/traces/cuda-h100 not present")
@pytest.mark.parametrize("path", H100_SNAPSHOTS, ids=lambda p: p.name)
def test_summary_matches_torch_memory_viz_on_real_h100_snapshots(path: Path) -> None:
    """Recompute every figure with torch's own _memory_viz helpers on snapshots of real
    trainers (the pickles need no GPU)."""
    mv = pytest.importorskip("torch.cuda._memory_viz")
    with path.open("rb") as f:
        snapshot = pickle.load(f)
    segments = snapshot["segments"]
    ours = summarize_segments(segments)["0"]
    # segsum's own accounting check passes, and its totals are ours.
    report = mv.segsum(snapshot)
    assert f"total_reserved: {mv.Bytes(ours['reserved_bytes'])}" in report
    assert f"total_allocated: {mv.Bytes(ours['allocated_bytes'])}" in report
    large = [s for s in segments if s["segment_type"] == "large"]
    free = {id(s): s["total_size"] - mv.calc_active(s) for s in large}
    stranded = sum(free[id(s)] for s in large if mv.calc_active(s) > 0 and not s["is_expandable"])
    wholly_free = [free[id(s)] for s in large if mv.calc_active(s) == 0]
    assert ours["stranded_bytes"] == stranded
    # Free blocks of expandable segments are not stranded, but they do serve requests.
    expandable = [
        b["size"]
        for s in large
        if s["is_expandable"]
        for b in s["blocks"]
        if b["state"] == "inactive"
    ]
    candidates = [*wholly_free, *expandable, ours["largest_stranded_bytes"]]
    assert ours["largest_request_bytes"] == max(candidates)
    assert ours["external_fragmentation"] == pytest.approx(
        stranded / sum(s["total_size"] for s in large)
    )
    # The figure the issue complained of counted whole free segments: it is far larger.
    inactive = ours["inactive_large_bytes"]
    old = 1 - ours["largest_inactive_large_bytes"] / inactive if inactive else 0.0
    assert ours["external_fragmentation"] <= old


def test_a_counter_that_did_not_move_counts_no_increase_as_a_moving_one_is_counted():
    """The window of a counter that did not move is told at once (no increase); one that
    moved, or went down and back to where it was, is counted as before."""
    from array import array

    from memtop.diagnosis.fragmentation import _increase

    assert _increase(array("d", [3.0] * 600)) == 0
    assert _increase([3.0, 3.0, 3.0]) == 0
    assert _increase(array("d", [3.0, 5.0, 3.0])) == 5  # after a reset it counts from its value
    assert _increase(array("d", [3.0, 1.0, 3.0])) == 3
    assert _increase(array("d", [1.0, 2.0, 4.0])) == 3
    assert _increase(array("d", [])) == 0
