"""The simulated caching allocator against the semantics of torch's CUDACachingAllocator."""

from __future__ import annotations

import itertools
import pickle
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memtop.sim.allocator import (
    STAT_NAMES,
    AllocatorConfig,
    SimulatedCachingAllocator,
    SimulatedOutOfMemoryError,
    format_size,
)
from memtop.sim.device import LocalDeviceMemory

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


def make(total: int = 80 * GiB, conf: str = "", overhead: int = 0) -> SimulatedCachingAllocator:
    return SimulatedCachingAllocator(LocalDeviceMemory(total, overhead), 0, conf)


def blocks_of(alloc: SimulatedCachingAllocator) -> list[list[tuple[str, int]]]:
    """Each segment as [(state, size), ...] in address order."""
    return [[(b["state"], b["size"]) for b in s["blocks"]] for s in alloc.memory_snapshot()]


# --------------------------------------------------------------------------------------------
# Sizes and pools


def test_small_request_rounds_to_512_and_lives_in_a_2mib_segment() -> None:
    a = make()
    addr = a.malloc(1000)
    s = a.memory_stats()
    assert a.allocation_size(addr) == 1024
    assert s["allocated_bytes.all.current"] == 1024
    assert s["allocated_bytes.small_pool.current"] == 1024
    assert s["requested_bytes.all.current"] == 1000
    assert s["reserved_bytes.small_pool.current"] == 2 * MiB
    assert s["reserved_bytes.large_pool.current"] == 0
    assert s["segment.small_pool.current"] == 1
    (seg,) = a.memory_snapshot()
    assert seg["segment_type"] == "small" and seg["total_size"] == 2 * MiB
    assert [(b["state"], b["size"]) for b in seg["blocks"]] == [
        ("active_allocated", 1024),
        ("inactive", 2 * MiB - 1024),
    ]
    # The remainder of a split small segment is stranded: inactive_split.
    assert s["inactive_split_bytes.small_pool.current"] == 2 * MiB - 1024
    assert s["inactive_split.small_pool.current"] == 1


@pytest.mark.parametrize(
    ("request_size", "block", "segment", "pool"),
    [
        (1, 512, 2 * MiB, "small"),
        (512, 512, 2 * MiB, "small"),
        (513, 1024, 2 * MiB, "small"),
        (1 * MiB, 1 * MiB, 2 * MiB, "small"),
        (1 * MiB + 1, 1 * MiB + 512, 20 * MiB, "large"),
        (5 * MiB, 5 * MiB, 20 * MiB, "large"),
        (10 * MiB - 512, 10 * MiB - 512, 20 * MiB, "large"),
        (10 * MiB, 10 * MiB, 10 * MiB, "large"),
        # At >= 10 MiB the segment is the request rounded to 2 MiB; a remainder <= 1 MiB
        # stays in the block, a larger one is split off.
        (11 * MiB + 1, 12 * MiB, 12 * MiB, "large"),
        (25 * MiB, 26 * MiB, 26 * MiB, "large"),
        (12 * MiB + 1, 12 * MiB + 512, 14 * MiB, "large"),
    ],
)
def test_rounding_and_segment_sizes(request_size: int, block: int, segment: int, pool: str) -> None:
    a = make()
    addr = a.malloc(request_size)
    assert a.allocation_size(addr) == block
    assert a.memory_reserved() == segment
    assert a.memory_snapshot()[0]["segment_type"] == pool
    assert a.memory_stats()[f"reserved_bytes.{pool}_pool.current"] == segment


def test_second_5mib_request_reuses_the_20mib_segment_by_splitting() -> None:
    a = make()
    first = a.malloc(5 * MiB)
    second = a.malloc(5 * MiB)
    s = a.memory_stats()
    assert s["reserved_bytes.all.current"] == 20 * MiB
    assert s["num_device_alloc"] == 1
    assert s["segment.large_pool.current"] == 1
    assert second == first + 5 * MiB
    assert blocks_of(a) == [
        [("active_allocated", 5 * MiB), ("active_allocated", 5 * MiB), ("inactive", 10 * MiB)]
    ]
    assert s["inactive_split_bytes.large_pool.current"] == 10 * MiB
    assert s["inactive_split.large_pool.current"] == 1


def test_freeing_everything_then_empty_cache_returns_reserved_to_zero() -> None:
    dev = LocalDeviceMemory(80 * GiB)
    a = SimulatedCachingAllocator(dev)
    addrs = [a.malloc(n) for n in (1000, 5 * MiB, 5 * MiB, 25 * MiB, 300 * KiB)]
    assert a.memory_reserved() == 2 * MiB + 20 * MiB + 26 * MiB
    for p in addrs:
        a.free(p)
    assert a.memory_allocated() == 0
    assert a.memory_reserved() == 48 * MiB  # cached, not returned
    assert dev.free_bytes() == 80 * GiB - 48 * MiB
    assert a.empty_cache() == 48 * MiB
    s = a.memory_stats()
    assert s["reserved_bytes.all.current"] == 0
    assert s["segment.all.current"] == 0
    assert s["inactive_split_bytes.all.current"] == 0
    assert s["num_device_free"] == 3
    assert s["reserved_bytes.all.freed"] == 48 * MiB
    assert dev.free_bytes() == 80 * GiB
    assert a.mem_get_info() == (80 * GiB, 80 * GiB)
    assert a.memory_snapshot() == []


def test_coalescing_merges_adjacent_free_blocks() -> None:
    a = make()
    x, y, z = (a.malloc(5 * MiB) for _ in range(3))
    assert a.memory_stats()["inactive_split.large_pool.current"] == 1
    a.free(x)
    # x is free but z and the tail are not adjacent to it.
    assert blocks_of(a) == [
        [
            ("inactive", 5 * MiB),
            ("active_allocated", 5 * MiB),
            ("active_allocated", 5 * MiB),
            ("inactive", 5 * MiB),
        ]
    ]
    assert a.memory_stats()["inactive_split.large_pool.current"] == 2
    a.free(y)
    assert blocks_of(a) == [
        [("inactive", 10 * MiB), ("active_allocated", 5 * MiB), ("inactive", 5 * MiB)]
    ]
    s = a.memory_stats()
    assert s["inactive_split.large_pool.current"] == 2
    assert s["inactive_split_bytes.large_pool.current"] == 15 * MiB
    a.free(z)
    # Everything merges back into one unsplit segment, which is no longer "split".
    assert blocks_of(a) == [[("inactive", 20 * MiB)]]
    s = a.memory_stats()
    assert s["inactive_split.large_pool.current"] == 0
    assert s["inactive_split_bytes.large_pool.current"] == 0


def test_empty_cache_keeps_partially_used_segments() -> None:
    a = make()
    keep = a.malloc(5 * MiB)
    gone = a.malloc(30 * MiB)
    a.malloc(100 * KiB)
    a.free(gone)
    assert a.memory_reserved() == 20 * MiB + 30 * MiB + 2 * MiB
    assert a.empty_cache() == 30 * MiB
    assert a.memory_reserved() == 22 * MiB
    assert a.allocation_size(keep) == 5 * MiB
    assert len(a.memory_snapshot()) == 2


def test_best_fit_picks_the_smallest_cached_block_that_fits() -> None:
    a = make()
    segs = {n: a.malloc(n) for n in (30 * MiB, 12 * MiB, 16 * MiB)}
    for addr in segs.values():
        a.free(addr)
    got = a.malloc(11 * MiB)
    assert got == segs[12 * MiB]
    # A 1 MiB remainder is not worth splitting in the large pool: the whole block is used.
    assert a.allocation_size(got) == 12 * MiB
    got = a.malloc(13 * MiB)
    assert got == segs[16 * MiB]
    # A 3 MiB remainder is split off.
    assert a.allocation_size(got) == 13 * MiB
    assert a.memory_stats()["num_device_alloc"] == 3


def test_best_fit_ties_go_to_the_lowest_address() -> None:
    a = make()
    first, second = a.malloc(12 * MiB), a.malloc(12 * MiB)
    a.free(second)
    a.free(first)
    assert a.malloc(12 * MiB) == min(first, second)


@pytest.mark.parametrize(
    ("remainder", "splits"), [(1 * MiB, False), (1 * MiB + 512, True), (512, False)]
)
def test_large_pool_splits_only_when_the_remainder_exceeds_1mib(
    remainder: int, splits: bool
) -> None:
    a = make()
    seg = a.malloc(20 * MiB)
    a.free(seg)
    got = a.malloc(20 * MiB - remainder)
    assert got == seg
    assert a.allocation_size(got) == (20 * MiB - remainder if splits else 20 * MiB)
    assert len(blocks_of(a)[0]) == (2 if splits else 1)


def test_small_pool_splits_down_to_512_bytes() -> None:
    a = make()
    a.malloc(1 * MiB)
    a.malloc(1 * MiB - 512)
    assert blocks_of(a) == [
        [("active_allocated", 1 * MiB), ("active_allocated", 1 * MiB - 512), ("inactive", 512)]
    ]
    a.malloc(512)
    assert blocks_of(a)[0][-1] == ("active_allocated", 512)
    assert a.memory_stats()["inactive_split_bytes.small_pool.current"] == 0


def test_cached_blocks_are_reused_on_their_own_stream_only() -> None:
    a = make()
    p = a.malloc(12 * MiB, stream=0)
    a.free(p)
    q = a.malloc(12 * MiB, stream=7)
    assert q != p
    assert a.memory_reserved() == 24 * MiB
    streams = sorted(s["stream"] for s in a.memory_snapshot())
    assert streams == [0, 7]
    a.free(q)
    assert a.malloc(12 * MiB, stream=7) == q


def test_zero_bytes_and_bad_addresses() -> None:
    a = make()
    assert a.malloc(0) == 0
    assert a.memory_stats()["allocation.all.allocated"] == 0
    a.free(0)  # like freeing nullptr
    p = a.malloc(100)
    with pytest.raises(ValueError):
        a.free(p + 512)
    a.free(p)
    with pytest.raises(ValueError):
        a.free(p)  # double free
    with pytest.raises(ValueError):
        a.allocation_size(p)
    with pytest.raises(ValueError):
        a.malloc(-1)


def test_addresses_are_realistic_distinct_and_reused() -> None:
    a = make()
    addrs = [a.malloc(n) for n in (100, 5 * MiB, 30 * MiB, 12 * MiB)]
    assert len(set(addrs)) == 4
    segs = a.memory_snapshot()
    for s in segs:
        assert s["address"] >= 0x7F0000000000
        assert s["address"] % (2 * MiB) == 0
    # Segments never overlap.
    spans = sorted((s["address"], s["address"] + s["total_size"]) for s in segs)
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))
    for p in addrs:
        a.free(p)
    a.empty_cache()
    # Like cudaMalloc, a released range is handed out again.
    assert a.malloc(30 * MiB) in {s["address"] for s in segs}


# --------------------------------------------------------------------------------------------
# Exhaustion


def test_exhaustion_frees_cached_segments_and_retries() -> None:
    dev = LocalDeviceMemory(60 * MiB)
    a = SimulatedCachingAllocator(dev)
    a.free(a.malloc(30 * MiB))  # 30 MiB cached, unusable for 40 MiB
    got = a.malloc(40 * MiB)
    s = a.memory_stats()
    assert a.allocation_size(got) == 40 * MiB
    assert s["num_alloc_retries"] == 1
    assert s["num_ooms"] == 0
    assert s["num_sync_all_streams"] == 1
    assert s["num_device_free"] == 1
    assert s["reserved_bytes.all.current"] == 40 * MiB
    assert s["reserved_bytes.all.peak"] == 40 * MiB


def test_true_exhaustion_raises_torch_shaped_oom_and_stays_usable() -> None:
    dev = LocalDeviceMemory(100 * MiB, overhead_bytes=6 * MiB)
    a = SimulatedCachingAllocator(dev, device_index=3)
    held = a.malloc(50 * MiB)
    small = a.malloc(3 * MiB)  # 20 MiB segment, 17 MiB of it free but split
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        a.malloc(30 * MiB)
    assert isinstance(info.value, RuntimeError)
    expected = (
        "CUDA out of memory. Tried to allocate 30.00 MiB. GPU 3 has a total capacity of "
        "100.00 MiB of which 24.00 MiB is free. Including non-PyTorch memory, this process "
        "has 76.00 MiB memory in use. Of the allocated memory 53.00 MiB is allocated by "
        "PyTorch, and 17.00 MiB is reserved by PyTorch but unallocated. If reserved but "
        "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF="
        "expandable_segments:True to avoid fragmentation.  See documentation for Memory "
        "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )
    assert str(info.value) == expected
    s = a.memory_stats()
    assert s["num_ooms"] == 1
    assert s["num_alloc_retries"] == 1
    assert s["allocated_bytes.all.current"] == 53 * MiB
    # The failed attempt left no trace in the accounting.
    assert s["reserved_bytes.all.current"] == 70 * MiB
    assert dev.free_bytes() == 24 * MiB
    a.free(held)
    a.free(small)
    got = a.malloc(30 * MiB)
    assert a.allocation_size(got) == 30 * MiB
    assert a.memory_stats()["num_ooms"] == 1


def test_oom_reports_segment_size_for_mid_sized_requests() -> None:
    a = make(total=10 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError, match=r"Tried to allocate 20\.00 MiB\. GPU 0"):
        a.malloc(5 * MiB)


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "0 bytes"),
        (1024, "1024 bytes"),
        (1025, "1.00 KiB"),
        (MiB, "1024.00 KiB"),
        (3 * MiB // 2, "1.50 MiB"),
        (GiB, "1024.00 MiB"),
        (int(79.1 * GiB), "79.10 GiB"),
    ],
)
def test_format_size_matches_torch(size: int, text: str) -> None:
    assert format_size(size) == text


# --------------------------------------------------------------------------------------------
# Statistics


def test_memory_stats_has_every_torch_key_from_the_start() -> None:
    s = make().memory_stats()
    expected = {
        f"{name}.{pool}.{field}"
        for name in STAT_NAMES
        for pool in ("all", "small_pool", "large_pool")
        for field in ("current", "peak", "allocated", "freed")
    }
    expected |= {
        f"{name}.{field}"
        for name in ("oversize_allocations", "oversize_segments")
        for field in ("current", "peak", "allocated", "freed")
    }
    expected |= {
        "num_alloc_retries",
        "num_ooms",
        "num_sync_all_streams",
        "num_device_alloc",
        "num_device_free",
        "max_split_size",
    }
    assert set(s) == expected
    assert list(s) == sorted(s)
    assert s["max_split_size"] == -1  # SIZE_MAX as torch reports it
    assert all(v == 0 for k, v in s.items() if k != "max_split_size")


def test_peak_tracking_and_reset() -> None:
    a = make()
    p = a.malloc(30 * MiB)
    q = a.malloc(12 * MiB)
    a.free(p)
    s = a.memory_stats()
    assert s["allocated_bytes.all.peak"] == 42 * MiB
    assert s["allocated_bytes.all.current"] == 12 * MiB
    assert s["allocated_bytes.all.allocated"] == 42 * MiB
    assert s["allocated_bytes.all.freed"] == 30 * MiB
    assert s["allocation.all.peak"] == 2
    assert a.max_memory_allocated() == 42 * MiB
    a.reset_peak_memory_stats()
    s = a.memory_stats()
    assert s["allocated_bytes.all.peak"] == 12 * MiB
    assert s["reserved_bytes.all.peak"] == 42 * MiB  # still reserved: cached
    assert s["allocated_bytes.all.allocated"] == 42 * MiB  # accumulated counts survive
    a.free(q)
    a.malloc(1 * MiB)
    assert a.memory_stats()["allocated_bytes.all.peak"] == 12 * MiB
    a.reset_accumulated_memory_stats()
    s = a.memory_stats()
    assert s["allocated_bytes.all.allocated"] == 0
    assert s["num_device_alloc"] == 0
    assert s["allocated_bytes.all.current"] == 1 * MiB


# --------------------------------------------------------------------------------------------
# Allocator configuration


def test_config_parsing() -> None:
    c = AllocatorConfig.parse("expandable_segments:True, max_split_size_mb:128")
    assert c.expandable_segments
    assert c.max_split_size == 128 * MiB
    c = AllocatorConfig.parse(
        "roundup_power2_divisions:[256:1,512:2,>:4],garbage_collection_threshold:0.6"
    )
    assert c.garbage_collection_threshold == 0.6
    # Intervals are indexed by log2 of their size in MiB.
    assert c.roundup_power2_divisions == (1,) * 9 + (2,) + (4,) * 6
    assert AllocatorConfig.parse("max_split_size_mb:20").max_split_size == 20 * MiB
    assert AllocatorConfig.parse("").max_split_size is None
    for bad in (
        "max_split_size_mb:19",  # must be >= 20
        "expandable_segments:yes",
        "no_such_option:1",
        "max_split_size_mb",
        "roundup_power2_divisions:3",
        "backend:cudaMallocAsync",
        "garbage_collection_threshold:1.5",
    ):
        with pytest.raises(ValueError):
            AllocatorConfig.parse(bad)


def test_roundup_power2_divisions_rounds_requests() -> None:
    a = make(conf="roundup_power2_divisions:4")
    # 1.2 MB lies between 1 MiB and 2 MiB: quarters of 256 KiB -> 1.25 MiB.
    p = a.malloc(1_200_000)
    assert a.allocation_size(p) == 1 * MiB + 256 * KiB
    # Powers of two and small sizes are left alone.
    assert a.allocation_size(a.malloc(4 * MiB)) == 4 * MiB
    assert a.allocation_size(a.malloc(1000)) == 1024


def test_max_split_size_oversize_rules() -> None:
    a = make(conf="max_split_size_mb:64")
    big = a.malloc(100 * MiB)
    s = a.memory_stats()
    assert s["max_split_size"] == 64 * MiB
    assert s["oversize_allocations.current"] == 1
    assert s["oversize_segments.current"] == 1
    a.free(big)
    assert a.memory_stats()["oversize_allocations.current"] == 0
    # A request below max_split_size never gets an oversize block...
    small = a.malloc(30 * MiB)
    assert small != big
    a.free(small)
    # ...nor a large one that would waste >= 20 MiB of it...
    other = a.malloc(70 * MiB)
    assert other != big
    # ...but one within 20 MiB takes it whole, unsplit.
    close = a.malloc(90 * MiB)
    assert close == big
    assert a.allocation_size(close) == 100 * MiB
    s = a.memory_stats()
    assert s["oversize_segments.current"] == 2
    assert s["oversize_allocations.current"] == 2


def test_max_split_size_frees_one_fitting_oversize_block_before_a_full_retry() -> None:
    a = make(total=190 * MiB, conf="max_split_size_mb:64")
    big = a.malloc(100 * MiB)
    keep = a.malloc(5 * MiB)
    a.free(big)
    # 80 MiB may not take the cached 100 MiB block (it would waste >= 20 MiB) and does not
    # fit beside it: that one oversize block goes back, without the full release and retry.
    got = a.malloc(80 * MiB)
    s = a.memory_stats()
    assert a.allocation_size(got) == 80 * MiB
    assert s["num_alloc_retries"] == 0
    assert s["num_sync_all_streams"] == 0
    assert s["num_device_free"] == 1
    assert s["oversize_segments.current"] == 1
    assert a.allocation_size(keep) == 5 * MiB


def test_max_split_size_frees_several_oversize_blocks_largest_first() -> None:
    a = make(total=200 * MiB, conf="max_split_size_mb:64")
    x, y = a.malloc(70 * MiB), a.malloc(70 * MiB)
    a.malloc(5 * MiB)
    a.free(x)
    a.free(y)
    got = a.malloc(120 * MiB)
    s = a.memory_stats()
    assert a.allocation_size(got) == 120 * MiB
    assert s["num_alloc_retries"] == 0
    assert s["num_device_free"] == 2
    assert s["reserved_bytes.all.current"] == 140 * MiB


def test_max_split_size_release_that_falls_short_still_retries() -> None:
    a = make(total=200 * MiB, conf="max_split_size_mb:64")
    big = a.malloc(100 * MiB)
    a.malloc(5 * MiB)
    a.free(big)
    # Releasing the 100 MiB block is not enough for 150 MiB on its own (torch then goes on
    # to release everything and retry, even though the memory is free by now).
    a.malloc(150 * MiB)
    s = a.memory_stats()
    assert s["num_alloc_retries"] == 1
    assert s["num_device_free"] == 1


def test_memory_fraction_caps_the_allocator() -> None:
    a = make(total=100 * MiB, conf="per_process_memory_fraction:0.5")
    a.malloc(40 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError, match=r"50\.00 MiB allowed; Of the allocated"):
        a.malloc(20 * MiB)
    b = make(total=100 * MiB)
    b.set_memory_fraction(0.3)
    with pytest.raises(SimulatedOutOfMemoryError):
        b.malloc(40 * MiB)


def test_garbage_collection_threshold_frees_old_cached_segments() -> None:
    a = make(total=100 * MiB, conf="garbage_collection_threshold:0.5")
    a.set_memory_fraction(1.0)  # torch's GC only runs with a memory fraction set
    a.free(a.malloc(40 * MiB))
    for _ in range(5):  # age the 40 MiB block while a 12 MiB one on stream 1 is reused
        a.free(a.malloc(12 * MiB, stream=1))
    assert a.memory_reserved() == 52 * MiB
    # 52 MiB cached > 50 % of 100 MiB: the cache miss collects the old block first, although
    # the new segment would have fit anyway.
    a.malloc(45 * MiB)
    s = a.memory_stats()
    assert s["num_device_free"] == 1
    assert s["num_alloc_retries"] == 0
    assert a.memory_reserved() == 12 * MiB + 46 * MiB


def test_expandable_segments_grow_one_mapping_and_report_no_inactive_split() -> None:
    dev = LocalDeviceMemory(1 * GiB)
    a = SimulatedCachingAllocator(dev, allocator_conf="expandable_segments:True")
    p = [a.malloc(7 * MiB) for _ in range(5)]
    # 35 MiB of blocks in one virtual range mapped 20 MiB page by 20 MiB page.
    assert a.memory_reserved() == 40 * MiB
    assert dev.free_bytes() == 1 * GiB - 40 * MiB
    (seg,) = a.memory_snapshot()
    assert seg["is_expandable"] is True
    assert seg["total_size"] == 40 * MiB
    assert [b["address"] for b in seg["blocks"][:5]] == [p[0] + i * 7 * MiB for i in range(5)]
    a.free(p[1])
    a.free(p[3])
    s = a.memory_stats()
    assert s["inactive_split_bytes.all.current"] == 0
    assert s["inactive_split.all.current"] == 0
    assert s["segment.all.current"] == 0  # torch counts cudaMalloc'd segments only
    # A freed gap is reused best-fit.
    assert a.malloc(6 * MiB) == p[1]
    for q in (p[0], p[2], p[4]):
        a.free(q)
    # 6 MiB at the start still holds page 0; page 1 (20-40 MiB) is wholly free and goes back.
    assert a.empty_cache() == 20 * MiB
    assert a.memory_reserved() == 20 * MiB
    assert [s["total_size"] for s in a.memory_snapshot()] == [20 * MiB]


def test_expandable_segments_unmap_everything_and_recover_from_exhaustion() -> None:
    dev = LocalDeviceMemory(100 * MiB)
    a = SimulatedCachingAllocator(dev, allocator_conf="expandable_segments:True")
    x = a.malloc(45 * MiB)  # maps 60 MiB
    a.free(x)
    y = a.malloc(70 * MiB)  # reuses the free 60 MiB and maps one more page
    assert y == x
    assert a.memory_reserved() == 80 * MiB
    a.free(y)
    big = a.malloc(90 * MiB)  # grows to the full 100 MiB
    assert a.memory_reserved() == 100 * MiB
    assert a.memory_stats()["num_alloc_retries"] == 0
    a.free(big)
    assert a.empty_cache() == 100 * MiB
    assert a.memory_snapshot() == []
    with pytest.raises(SimulatedOutOfMemoryError):
        a.malloc(101 * MiB)
    assert a.memory_stats()["num_ooms"] == 1


def test_expandable_segments_split_any_remainder_of_512_bytes_or_more() -> None:
    a = make(conf="expandable_segments:True")
    p = a.malloc(20 * MiB - 512 * KiB)
    # Unlike a plain large segment, a 512 KiB remainder is split off, not handed out.
    assert a.allocation_size(p) == 20 * MiB - 512 * KiB
    assert blocks_of(a) == [[("active_allocated", 20 * MiB - 512 * KiB), ("inactive", 512 * KiB)]]


def test_expandable_best_fit_prefers_a_gap_to_the_growable_tail() -> None:
    a = make(conf="expandable_segments:True")
    a.malloc(6 * MiB)
    gap = a.malloc(8 * MiB)
    a.malloc(1 * MiB + 512)
    a.free(gap)
    tail = [b for b in a.memory_snapshot()[0]["blocks"] if b["state"] == "inactive"][-1]
    assert tail["size"] == 5 * MiB - 512
    # The tail is the smaller free block, but it can grow into unmapped space: torch ranks it
    # by that growable size and takes the 8 MiB gap instead.
    assert a.malloc(4 * MiB) == gap


def test_small_pool_with_expandable_segments_maps_2mib_pages() -> None:
    a = make(conf="expandable_segments:True")
    for _ in range(5):
        a.malloc(1 * MiB)
    assert a.memory_stats()["reserved_bytes.small_pool.current"] == 6 * MiB
    segs = a.memory_snapshot()
    assert [(s["segment_type"], s["total_size"]) for s in segs] == [("small", 6 * MiB)]


# --------------------------------------------------------------------------------------------
# Consistency under random workloads


def check_invariants(
    a: SimulatedCachingAllocator, live: dict[int, int], dev: LocalDeviceMemory
) -> None:
    s = a.memory_stats()
    snap = a.memory_snapshot()
    expandable = a.config.expandable_segments
    for pool in ("small", "large"):
        segs = [seg for seg in snap if seg["segment_type"] == pool]
        blocks = [b for seg in segs for b in seg["blocks"]]
        active = [b for b in blocks if b["state"] == "active_allocated"]
        key = f"{pool}_pool.current"
        assert s[f"allocated_bytes.{key}"] == sum(b["size"] for b in active)
        assert s[f"active_bytes.{key}"] == s[f"allocated_bytes.{key}"]
        assert s[f"allocation.{key}"] == len(active)
        assert s[f"requested_bytes.{key}"] == sum(b["requested_size"] for b in active)
        assert s[f"reserved_bytes.{key}"] == sum(seg["total_size"] for seg in segs)
        split_free = [
            b
            for seg in segs
            if len(seg["blocks"]) > 1
            for b in seg["blocks"]
            if b["state"] == "inactive"
        ]
        if expandable:
            assert s[f"inactive_split_bytes.{key}"] == 0
            assert s[f"segment.{key}"] == 0
        else:
            assert s[f"inactive_split_bytes.{key}"] == sum(b["size"] for b in split_free)
            assert s[f"inactive_split.{key}"] == len(split_free)
            assert s[f"segment.{key}"] == len(segs)
    for name in STAT_NAMES:
        assert s[f"{name}.all.current"] == (
            s[f"{name}.small_pool.current"] + s[f"{name}.large_pool.current"]
        )
        for pool in ("all", "small_pool", "large_pool"):
            assert s[f"{name}.{pool}.peak"] >= s[f"{name}.{pool}.current"] >= 0
            assert (
                s[f"{name}.{pool}.allocated"] - s[f"{name}.{pool}.freed"]
                == s[f"{name}.{pool}.current"]
            )
    for seg in snap:
        # Blocks tile the segment, and coalescing leaves no two free neighbours.
        addr = seg["address"]
        for b in seg["blocks"]:
            assert b["address"] == addr
            addr += b["size"]
        assert addr == seg["address"] + seg["total_size"]
        states = [b["state"] for b in seg["blocks"]]
        assert ("inactive", "inactive") not in itertools.pairwise(states)
    assert sorted(
        b["address"] for seg in snap for b in seg["blocks"] if b["state"] != "inactive"
    ) == sorted(live)
    for addr, n in live.items():
        assert a.allocation_size(addr) >= a.round_size(n)
    assert s["requested_bytes.all.current"] == sum(live.values())
    assert dev.total_bytes - dev.free_bytes() == s["reserved_bytes.all.current"]
    assert s["num_ooms"] <= s["num_alloc_retries"]


sizes = st.one_of(
    st.integers(1, 4096),
    st.integers(4097, 1 * MiB),
    st.integers(1 * MiB + 1, 10 * MiB),
    st.integers(10 * MiB, 60 * MiB),
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), sizes, st.sampled_from([0, 0, 0, 1])),
        st.tuples(st.just("free"), st.integers(0, 10**6), st.just(0)),
        st.tuples(st.just("empty_cache"), st.just(0), st.just(0)),
    ),
    max_size=60,
)


@pytest.mark.parametrize(
    "conf", ["", "max_split_size_mb:40", "expandable_segments:True", "roundup_power2_divisions:4"]
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=ops)
def test_stats_agree_with_the_snapshot_under_random_workloads(
    conf: str, program: list[tuple[str, int, int]]
) -> None:
    dev = LocalDeviceMemory(256 * MiB)
    a = SimulatedCachingAllocator(dev, allocator_conf=conf)
    live: dict[int, int] = {}
    ooms = 0
    for op, arg, stream in program:
        if op == "malloc":
            try:
                live[a.malloc(arg, stream=stream)] = arg
            except SimulatedOutOfMemoryError:
                ooms += 1
        elif op == "free" and live:
            addr = sorted(live)[arg % len(live)]
            a.free(addr)
            del live[addr]
        elif op == "empty_cache":
            a.empty_cache()
        check_invariants(a, live, dev)
    assert a.memory_stats()["num_ooms"] == ooms
    for addr in list(live):
        a.free(addr)
    a.empty_cache()
    s = a.memory_stats()
    assert s["reserved_bytes.all.current"] == 0
    assert s["allocated_bytes.all.current"] == 0
    assert dev.free_bytes() == dev.total_bytes


def test_concurrent_readers_and_writers() -> None:
    a = make(total=4 * GiB)
    errors: list[BaseException] = []
    stop = threading.Event()

    def trainer(seed: int) -> None:
        try:
            held: list[int] = []
            for i in range(400):
                held.append(a.malloc((seed * 7919 + i * 104729) % (12 * MiB) + 1))
                if len(held) > 8:
                    a.free(held.pop(0))
            for p in held:
                a.free(p)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def reader() -> None:
        try:
            while not stop.is_set():
                s = a.memory_stats()
                # Every read is one consistent state, never a half-done malloc.
                assert s["allocated_bytes.all.current"] <= s["reserved_bytes.all.current"]
                assert s["allocated_bytes.all.current"] == (
                    s["allocated_bytes.small_pool.current"]
                    + s["allocated_bytes.large_pool.current"]
                )
                segs = a.memory_snapshot()
                assert sum(seg["total_size"] for seg in segs) >= sum(
                    seg["allocated_size"] for seg in segs
                )
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=trainer, args=(k,)) for k in range(3)]
    r = threading.Thread(target=reader)
    r.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    r.join()
    assert not errors
    assert a.memory_allocated() == 0
    assert a.memory_stats()["allocation.all.current"] == 0


# --------------------------------------------------------------------------------------------
# torch's own tools read the snapshot


def _flamegraph_total(lines: str) -> int:
    return sum(int(line.rsplit(" ", 1)[1]) for line in lines.splitlines() if line.strip())


def test_torch_memory_viz_reads_the_snapshot(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from torch.cuda import _memory_viz

    a = make()
    held = [a.malloc(n) for n in (1000, 5 * MiB, 5 * MiB + 3, 25 * MiB, 300 * KiB, 64 * MiB)]
    a.free(held[1])
    a.free(held[4])
    stats = a.memory_stats()
    snap = a.snapshot()
    assert set(snap) >= {"segments", "device_traces", "allocator_settings"}

    path = tmp_path / "snapshot.pickle"
    with open(path, "wb") as f:
        pickle.dump(snap, f)
    with open(path, "rb") as f:
        loaded: dict[str, Any] = pickle.load(f)
    assert loaded == snap

    text = _memory_viz.segsum(loaded)
    reserved = re.search(r"^total_reserved: (\S+)$", text, re.M)
    allocated = re.search(r"^total_allocated: (\S+)$", text, re.M)
    nsegs = re.search(r"^segments: (\d+)$", text, re.M)
    assert reserved and allocated and nsegs
    assert reserved.group(1) == repr(_memory_viz.Bytes(stats["reserved_bytes.all.current"]))
    # segsum's "allocated" is what was requested: it reports rounding as internal free space.
    assert allocated.group(1) == repr(_memory_viz.Bytes(stats["requested_bytes.all.current"]))
    assert int(nsegs.group(1)) == stats["segment.all.current"]

    # segments()/memory() emit flame-graph lines whose counts add up to every reserved byte.
    by_segment = _memory_viz.segments(loaded, format_flamegraph=lambda lines: lines)
    by_stream = _memory_viz.memory(loaded, format_flamegraph=lambda lines: lines)
    assert _flamegraph_total(by_segment) == stats["reserved_bytes.all.current"]
    assert _flamegraph_total(by_stream) == stats["reserved_bytes.all.current"]
    active = sum(
        int(line.rsplit(" ", 1)[1])
        for line in by_stream.splitlines()
        if ";active_allocated;" in line and "<gaps>" not in line
    )
    assert active == stats["requested_bytes.all.current"]

    # The HTML viewer embeds the pickled snapshot as it is.
    assert "snapshot.pickle" in _memory_viz.segment_plot(loaded)

    # compare() of two snapshots sees the segment added in between.
    a.malloc(40 * MiB)
    diff = _memory_viz.compare(
        loaded["segments"], a.snapshot()["segments"], format_flamegraph=lambda lines: lines
    )
    assert diff.count("only_after;") >= 1
    assert "only_before;" not in diff


@pytest.mark.parametrize("scenario", ["fragment", "oom", "server-overrun"])
def test_active_figures_are_the_allocated_ones_through_ooms_resets_and_settings(
    scenario: str,
) -> None:
    # The allocator keeps one set of counters for allocation/active and allocated_bytes/
    # active_bytes (no simulated block waits on a second stream's events): every figure of
    # both names stays equal, pool by pool, through retries, OOMs, empty_cache and resets.
    from memtop.sim.scenarios import ServerWorkload, Workload, model_for

    for conf in ("", "expandable_segments:True", "max_split_size_mb:20"):
        total = 12 * GiB
        alloc = SimulatedCachingAllocator(LocalDeviceMemory(total, overhead_bytes=0), 0, conf)
        workload: Workload | ServerWorkload
        if scenario.startswith("server"):
            workload = ServerWorkload(scenario, alloc, total, 0.9, 0, seed=1, grow_after=3)
        else:
            workload = Workload(scenario, alloc, model_for(scenario, total), seed=1)
        for step in range(24):
            workload.step()
            if step == 8:
                alloc.empty_cache()
            if step == 12:
                alloc.reset_peak_memory_stats()
            if step == 16:
                alloc.reset_accumulated_memory_stats()
            stats = alloc.memory_stats()
            for key, value in stats.items():
                if key.startswith("active."):
                    assert value == stats[key.replace("active.", "allocation.")], (conf, key)
                elif key.startswith("active_bytes."):
                    assert value == stats[key.replace("active_", "allocated_")], (conf, key)
        assert stats["num_alloc_retries"] + workload.ooms > 0 or scenario == "fragment"
