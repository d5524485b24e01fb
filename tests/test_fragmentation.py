"""Fragmentation, internal fragmentation and pressure deltas of one agent device (DESIGN §4)."""

from __future__ import annotations

from memtop.diagnosis.fragmentation import fragmentation, pressure
from memtop.model import AgentDeviceSample

MiB = 1 << 20


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
    summary = {"external_fragmentation": 0.75, "largest_inactive_large_bytes": 4 * MiB}
    frag = fragmentation(latest, [], summary, 12.0)
    assert frag.internal_bytes == 3 * MiB
    assert frag.external == 0.75 and frag.largest_free_block_bytes == 4 * MiB
    assert frag.external_age_s == 12.0
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


def test_pressure_without_enough_history_falls_back_to_the_totals():
    latest = sample(num_alloc_retries=8, num_ooms=0)
    p = pressure(latest, [0.0, 0.3], [8.0, 8.0], [0.0, 0.0])
    assert p.retries_recent is None and p.retries == 8
