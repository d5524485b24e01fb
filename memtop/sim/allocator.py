"""A simulated PyTorch CUDA caching allocator, pure Python.

It follows c10/cuda/CUDACachingAllocator.cpp (DeviceCachingAllocator) closely enough that
fragmentation, cache reuse, retries and OOMs happen for the same request sequences as on a GPU,
and it reports them with torch's own vocabulary: `memory_stats()` has torch.cuda.memory_stats()'s
keys, `snapshot()` has torch.cuda.memory._snapshot()'s shape (torch.cuda._memory_viz reads it).

What is modelled: 512-byte rounding (and `roundup_power2_divisions`), the small (<= 1 MiB,
2 MiB segments) and large (20 MiB segments below 10 MiB, else rounded to 2 MiB) pools, per-stream
best-fit reuse, block splitting and coalescing, `max_split_size_mb` with its oversize rules,
`max_non_split_rounding_mb`, the release-oversize / release-all-cached / retry path on device
exhaustion, the OOM message, `expandable_segments:True`, the per-process memory fraction and the
garbage-collection threshold.  What is not: CUDA events and cross-stream use (`record_stream`),
so blocks are never "active_pending_free"; CUDA graph private pools; allocation history traces.

The device behind it is a `DeviceMemory` (see device.py): cudaMalloc may fail there because
other simulated processes hold memory, just as on a shared GPU.
"""

from __future__ import annotations

import bisect
import sys
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import field
from typing import Any

from memtop.agent import stacks
from memtop.base import alloc_conf
from memtop.base.records import record
from memtop.sim.device import DeviceMemory, published_once

__all__ = [
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "STAT_NAMES",
    "AllocatorConfig",
    "SimulatedCachingAllocator",
    "SimulatedOutOfMemoryError",
    "format_size",
]

MiB = 1024 * 1024

# The constants of CUDACachingAllocator.cpp.
K_MIN_BLOCK_SIZE = 512  # all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 * MiB  # largest "small" allocation
K_SMALL_BUFFER = 2 * MiB  # small requests are packed into 2 MiB segments
K_LARGE_BUFFER = 20 * MiB  # 1-10 MiB requests get a 20 MiB segment
K_MIN_LARGE_ALLOC = 10 * MiB  # from here on segments are sized to the request
K_ROUND_LARGE = 2 * MiB  # ... rounded up to 2 MiB
K_ROUNDUP_POWER2_INTERVALS = 16  # roundup_power2_divisions covers 1 MiB .. 64 GiB

# torch reports an unset max_split_size as SIZE_MAX cast to int64.
_UNSET_MAX_SPLIT_SIZE = -1
# The allocator's bound for oversize blocks when max_split_size is unset: larger than any size.
_NO_MAX_SPLIT = 1 << 127

STAT_NAMES = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
_FIELDS = ("current", "peak", "allocated", "freed")
_COUNTERS = (
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
)

_VA_BASE = 0x7F0000000000
_VA_ALIGN = 2 * MiB


class SimulatedOutOfMemoryError(RuntimeError):
    """Raised where torch raises torch.OutOfMemoryError (itself a RuntimeError)."""


def format_size(size: int) -> str:
    """torch's format_size(): two decimals, binary units, "bytes" up to 1 KiB."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024.0:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576.0:.2f} MiB"
    return f"{size / 1073741824.0:.2f} GiB"


# --------------------------------------------------------------------------------------------
# PYTORCH_CUDA_ALLOC_CONF: tokens and booleans as memtop.base.alloc_conf reads them (torch's way);
# the keys, checks and defaults below are torch's too, and it refuses what torch refuses.


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _parse_bool(key: str, value: str) -> bool:
    found = alloc_conf.boolean(value)  # torch's spelling: True or False, nothing else
    if found is None:
        raise ValueError(f"allocator option {key} expects True or False, got {value!r}")
    return found


@record(frozen=True)
class AllocatorConfig:
    """A parsed PYTORCH_CUDA_ALLOC_CONF (same keys, checks and defaults as torch)."""

    raw: str = ""
    max_split_size: int | None = None  # None: unlimited (torch: SIZE_MAX)
    max_non_split_rounding_size: int = K_LARGE_BUFFER
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    roundup_power2_divisions: tuple[int, ...] = (0,) * K_ROUNDUP_POWER2_INTERVALS
    per_process_memory_fraction: float | None = None
    release_lock_on_cudamalloc: bool = False
    pinned_use_cuda_host_register: bool = False
    pinned_num_register_threads: int = 1
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, conf: str) -> AllocatorConfig:
        tokens = alloc_conf.tokenize(conf or "")
        values: dict[str, Any] = {}
        extra: dict[str, str] = {}
        i = 0

        def expect(tok: str) -> None:
            nonlocal i
            if i >= len(tokens) or tokens[i] != tok:
                got = tokens[i] if i < len(tokens) else "end of string"
                raise ValueError(f"allocator config {conf!r}: expected {tok!r}, got {got!r}")
            i += 1

        def word() -> str:
            nonlocal i
            if i >= len(tokens) or tokens[i] in ",:[]":
                raise ValueError(f"allocator config {conf!r}: missing value")
            i += 1
            return tokens[i - 1]

        def integer(key: str, text: str) -> int:
            try:
                return int(text)
            except ValueError:
                raise ValueError(
                    f"allocator option {key} expects an integer, got {text!r}"
                ) from None

        while i < len(tokens):
            if tokens[i] == ",":
                i += 1
                continue
            key = word()
            expect(":")
            if key == "max_split_size_mb":
                mb = integer(key, word())
                if mb < K_LARGE_BUFFER // MiB:
                    raise ValueError(
                        f"CachingAllocator option max_split_size_mb too small, "
                        f"must be >= {K_LARGE_BUFFER // MiB}"
                    )
                values["max_split_size"] = mb * MiB
            elif key == "max_non_split_rounding_mb":
                mb = integer(key, word())
                if mb < K_LARGE_BUFFER // MiB:
                    raise ValueError(
                        f"CachingAllocator option max_non_split_rounding_mb too small, "
                        f"must be >= {K_LARGE_BUFFER // MiB}"
                    )
                values["max_non_split_rounding_size"] = mb * MiB
            elif key == "garbage_collection_threshold":
                text = word()
                try:
                    threshold = float(text)
                except ValueError:
                    raise ValueError(f"{key} expects a number, got {text!r}") from None
                if not 0.0 < threshold < 1.0:
                    raise ValueError(f"{key} must be in (0.0, 1.0), got {threshold}")
                values["garbage_collection_threshold"] = threshold
            elif key == "per_process_memory_fraction":
                text = word()
                try:
                    fraction = float(text)
                except ValueError:
                    raise ValueError(f"{key} expects a number, got {text!r}") from None
                if not 0.0 <= fraction <= 1.0:
                    raise ValueError(f"{key} must be in [0.0, 1.0], got {fraction}")
                values["per_process_memory_fraction"] = fraction
            elif key == "roundup_power2_divisions":
                values["roundup_power2_divisions"] = cls._parse_roundup(tokens, i, conf)
                # Skip what _parse_roundup consumed.
                if tokens[i] == "[":
                    i = tokens.index("]", i) + 1
                else:
                    i += 1
            elif key == "expandable_segments":
                values["expandable_segments"] = _parse_bool(key, word())
            elif key == "release_lock_on_cudamalloc":
                values["release_lock_on_cudamalloc"] = _parse_bool(key, word())
            elif key == "pinned_use_cuda_host_register":
                values["pinned_use_cuda_host_register"] = _parse_bool(key, word())
            elif key == "pinned_num_register_threads":
                n = integer(key, word())
                if not _is_pow2(n):
                    raise ValueError(f"{key} must be a power of 2, got {n}")
                values["pinned_num_register_threads"] = n
            elif key == "backend":
                backend = word()
                if backend != "native":
                    raise ValueError(
                        f"allocator backend {backend!r} is not simulated (native only)"
                    )
                extra[key] = backend
            elif key in (
                "pinned_use_background_threads",
                "graph_capture_record_stream_reuse",
                "pinned_reserve_segment_size_mb",
            ):
                # Host-side or CUDA-graph options with no effect on device memory.
                extra[key] = word()
            else:
                raise ValueError(f"Unrecognized key {key!r} in allocator config {conf!r}")
            if i < len(tokens):
                expect(",")
        return cls(raw=conf or "", extra=extra, **values)

    @staticmethod
    def _parse_roundup(tokens: list[str], i: int, conf: str) -> tuple[int, ...]:
        divisions = [0] * K_ROUNDUP_POWER2_INTERVALS

        def number(text: str, what: str, zero_ok: bool = False) -> int:
            try:
                n = int(text)
            except ValueError:
                raise ValueError(f"roundup_power2_divisions: bad {what} {text!r}") from None
            if not (_is_pow2(n) or (zero_ok and n == 0)):
                raise ValueError(f"For roundups, the {what} has to be power of 2, got {n}")
            return n

        if i >= len(tokens):
            raise ValueError(f"allocator config {conf!r}: missing value")
        if tokens[i] != "[":
            return (number(tokens[i], "divisions"),) * K_ROUNDUP_POWER2_INTERVALS
        # "[256:1,512:2,>:4]": interval (in MiB, a power of 2) -> divisions; ">" for the rest.
        # The first interval also covers everything below it; ">" everything above the last.
        i += 1
        last = 0
        first = True
        while i < len(tokens) and tokens[i] != "]":
            interval, colon = tokens[i], tokens[i + 1] if i + 1 < len(tokens) else ""
            if colon != ":" or i + 2 >= len(tokens):
                raise ValueError(f"allocator config {conf!r}: bad roundup_power2_divisions")
            value = number(tokens[i + 2], "divisions", zero_ok=True)
            i += 3
            if interval == ">":
                for k in range(last + 1, K_ROUNDUP_POWER2_INTERVALS):
                    divisions[k] = value
            else:
                index = min(number(interval, "intervals").bit_length() - 1, len(divisions) - 1)
                if first:
                    for k in range(index):
                        divisions[k] = value
                    first = False
                divisions[index] = value
                last = index
            if i < len(tokens) and tokens[i] == ",":
                i += 1
        if i >= len(tokens):
            raise ValueError(f"allocator config {conf!r}: unclosed '['")
        return tuple(divisions)

    def roundup_divisions_for(self, size: int) -> int:
        index = size.bit_length() - 1 - 20  # intervals start at 1 MiB
        index = max(0, min(index, K_ROUNDUP_POWER2_INTERVALS - 1))
        return self.roundup_power2_divisions[index]


# --------------------------------------------------------------------------------------------
# Allocator state


class _Stat:
    """One figure of torch's statistics (for one pool, or all pools).

    A statistic of the allocator is a triple (all, small pool, large pool).  The all-pools one
    keeps `current` and `peak` only: its `allocated` and `freed` are the pools' sums, added up
    when read (memory_stats), one update fewer per figure on every malloc and free."""

    __slots__ = ("allocated", "current", "freed", "peak")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.allocated = 0
        self.freed = 0

    def inc(self, n: int) -> None:
        self.current += n
        if self.current > self.peak:
            self.peak = self.current
        self.allocated += n

    def dec(self, n: int) -> None:
        self.current -= n
        self.freed += n


class _Segment:
    """One cudaMalloc'd segment, or the virtual range of one expandable segment."""

    __slots__ = ("expandable", "head", "is_small", "page", "size", "start", "stream")

    def __init__(
        self, start: int, size: int, stream: int, is_small: bool, expandable: bool, page: int
    ) -> None:
        self.start = start
        self.size = size
        self.stream = stream
        self.is_small = is_small
        self.expandable = expandable
        self.page = page  # mapping granularity of an expandable segment
        self.head: _Block | None = None


class _Block:
    __slots__ = (
        "addr",
        "allocated",
        "gc_base",
        "mapped",
        "next",
        "prev",
        "requested",
        "seg",
        "size",
        "stream",
    )

    def __init__(self, addr: int, size: int, seg: _Segment, mapped: bool = True) -> None:
        self.addr = addr
        self.size = size
        self.seg = seg
        self.stream = seg.stream
        self.requested = 0
        self.allocated = False
        self.mapped = mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.gc_base = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


# A free block's place in its pool's order: (size, address) as one int, size in the high bits.
# Device addresses are 64-bit, so the order of these ints is the order of the pairs, and bisect
# compares two ints where it compared two tuples element by element (half the instructions of
# a search in a trainer's pool).
_ADDR_BITS = 64
_ADDR_MASK = (1 << _ADDR_BITS) - 1


class _Pool:
    """The free blocks of one pool, ordered as torch's BlockComparatorSize: (stream, size, addr).

    One sorted list of (size, addr) keys per stream (see _ADDR_BITS) with bisect: O(log n) to
    search and a memmove to update, which beats a balanced tree in Python for the few thousand
    cached blocks a trainer has.  `blocks` holds the same blocks by address, in the order they
    were cached (releasing the cache walks it in that order, which decides the addresses that
    are freed, and so reused, first).

    The pool's own statistics (its half of each _Stat triple) are attributes here, so that the
    hot path reads them without picking the pool's element of a tuple.
    """

    __slots__ = (
        "allocated_bytes",
        "allocation",
        "blocks",
        "free_calls",
        "inactive_split",
        "inactive_split_bytes",
        "is_small",
        "keys",
        "requested_bytes",
        "unmapped",
        "unmapped_keys",
    )

    def __init__(self, is_small: bool, stats: dict[str, tuple[_Stat, _Stat, _Stat]]) -> None:
        self.is_small = is_small
        self.keys: defaultdict[int, list[int]] = defaultdict(list)  # stream -> sorted keys
        self.blocks: dict[int, _Block] = {}
        # Unmapped parts of expandable segments: stream -> sorted addresses.
        self.unmapped_keys: defaultdict[int, list[int]] = defaultdict(list)
        self.unmapped: dict[int, _Block] = {}
        self.free_calls = 0  # get_free_block calls, the clock of the GC's block ages
        mine = 1 if is_small else 2
        self.allocation = stats["allocation"][mine]
        self.allocated_bytes = stats["allocated_bytes"][mine]
        self.requested_bytes = stats["requested_bytes"][mine]
        self.inactive_split = stats["inactive_split"][mine]
        self.inactive_split_bytes = stats["inactive_split_bytes"][mine]

    def insert(self, b: _Block) -> None:
        bisect.insort(self.keys[b.stream], b.size << _ADDR_BITS | b.addr)
        self.blocks[b.addr] = b
        b.gc_base = self.free_calls

    def remove(self, b: _Block) -> None:
        keys = self.keys[b.stream]
        key = b.size << _ADDR_BITS | b.addr
        i = bisect.bisect_left(keys, key)
        if i == len(keys) or keys[i] != key:
            raise AssertionError(f"block {b.addr:#x} is not in the pool")
        del keys[i]
        del self.blocks[b.addr]

    def insert_unmapped(self, b: _Block) -> None:
        bisect.insort(self.unmapped_keys[b.stream], b.addr)
        self.unmapped[b.addr] = b

    def remove_unmapped(self, b: _Block) -> None:
        keys = self.unmapped_keys[b.stream]
        i = bisect.bisect_left(keys, b.addr)
        if i == len(keys) or keys[i] != b.addr:
            raise AssertionError(f"unmapped block {b.addr:#x} is not in the pool")
        del keys[i]
        del self.unmapped[b.addr]


class _AddressSpace:
    """Fake device virtual addresses: first fit in freed ranges, then a bump pointer.

    Freed ranges are reused as cudaMalloc reuses addresses, so a long run with empty_cache()
    churn keeps addresses in a realistic range.
    """

    def __init__(self, base: int) -> None:
        self._top = base
        self._free: list[tuple[int, int]] = []  # (start, size), sorted, coalesced

    def alloc(self, size: int) -> int:
        size = -(-size // _VA_ALIGN) * _VA_ALIGN
        for i, (start, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, free - size)
                return start
        start = self._top
        self._top += size
        return start

    def free(self, start: int, size: int) -> None:
        size = -(-size // _VA_ALIGN) * _VA_ALIGN
        i = bisect.bisect_left(self._free, (start, 0))
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
            i -= 1
            start, size = self._free[i][0], self._free[i][1] + size
            del self._free[i]
        if i < len(self._free) and start + size == self._free[i][0]:
            size += self._free[i][1]
            del self._free[i]
        if start + size == self._top:
            self._top = start
        else:
            self._free.insert(i, (start, size))


# --------------------------------------------------------------------------------------------
# The allocator


class SimulatedCachingAllocator:
    """One device's caching allocator (torch's DeviceCachingAllocator), thread-safe.

    `malloc` returns a fake device address; `free` takes it back.  Statistics are kept
    incrementally, so `memory_stats()` costs the same whatever the number of blocks.
    """

    def __init__(
        self, device: DeviceMemory, device_index: int = 0, allocator_conf: str = ""
    ) -> None:
        self.device = device
        self.device_index = device_index
        self._lock = threading.Lock()
        self._active: dict[int, _Block] = {}
        self._segments: dict[int, _Segment] = {}
        self._va = _AddressSpace(_VA_BASE)
        self._total_allocated_memory = 0  # what this allocator holds on the device
        self._allowed_max: int | None = None
        self._apply_config(AllocatorConfig.parse(allocator_conf))
        if self.config.per_process_memory_fraction is not None:
            self._set_fraction(self.config.per_process_memory_fraction)
        self._stats: dict[str, tuple[_Stat, _Stat, _Stat]] = {
            name: (_Stat(), _Stat(), _Stat()) for name in STAT_NAMES
        }
        # torch's "active" blocks are the allocated ones plus the freed ones still awaiting
        # another stream's events (record_stream).  No simulated block is used on a second
        # stream, so active is allocation and active_bytes is allocated_bytes, figure for
        # figure: one set of counters serves both names, and malloc/free keep three, not five.
        self._stats["active"] = self._stats["allocation"]
        self._stats["active_bytes"] = self._stats["allocated_bytes"]
        self._small = _Pool(True, self._stats)
        self._large = _Pool(False, self._stats)
        self._oversize_allocations = _Stat()
        self._oversize_segments = _Stat()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        s = self._stats
        self._allocation = s["allocation"]
        self._segment = s["segment"]
        self._inactive_split = s["inactive_split"]
        self._allocated_bytes = s["allocated_bytes"]
        self._reserved_bytes = s["reserved_bytes"]
        self._inactive_split_bytes = s["inactive_split_bytes"]
        self._requested_bytes = s["requested_bytes"]
        # The figures of all pools, which every malloc and free updates in place
        self._all_allocation = self._allocation[0]
        self._all_allocated_bytes = self._allocated_bytes[0]
        self._all_requested_bytes = self._requested_bytes[0]
        self._all_inactive_split = self._inactive_split[0]
        self._all_inactive_split_bytes = self._inactive_split_bytes[0]
        self._oom_observers: list[Callable[[int, int, int, int], Any]] = []
        self._last_oom = (device_index, 0, 0, 0)
        # History (torch's _record_memory_history(enabled="state", context="alloc",
        # stacks="python")): each live block's allocating user frames, by address.
        self._history = False
        self._frames: dict[int, list[dict[str, Any]]] = {}

    # -- public API ----------------------------------------------------------------------------

    # malloc and free run ~3,500 times a second each in a simulated trainer, most of its CPU:
    # their common case is written out in one function each (no call per step of it, the
    # statistics updated in place); the rarer paths are calls.

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """Allocate `nbytes` on `stream`; returns the block's address (0 for 0 bytes, no stats)."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        if nbytes == 0:
            return 0
        # Off the lock, and only with history on: a bounded walk of the caller's frames.
        frames = stacks.user_frames(sys._getframe(1)) if self._history else None
        # acquire/release, not `with`: half the cost, on a path a trainer takes ~3,500 times a
        # second (malloc and free alike).
        self._lock.acquire()
        try:
            orig_size = int(nbytes)
            stream = int(stream)
            # round_size, written out for the common settings
            if orig_size < K_MIN_BLOCK_SIZE:
                size = K_MIN_BLOCK_SIZE
            elif self._power2_rounding:
                size = self.round_size(orig_size)
            else:
                size = (orig_size + K_MIN_BLOCK_SIZE - 1) & -K_MIN_BLOCK_SIZE
            pool = self._small if size <= K_SMALL_SIZE else self._large
            # get_free_block: the best fit, the smallest (size, address) that is large enough
            if self._gc:
                pool.free_calls += 1
            keys = pool.keys[stream]
            i = bisect.bisect_left(keys, size << _ADDR_BITS)
            block: _Block | None = None
            if i < len(keys):
                blocks = pool.blocks
                block = blocks[keys[i] & _ADDR_MASK]
                if block.seg.expandable:
                    block, i = self._expandable_best_fit(pool, keys, i)
                # Oversize blocks (>= max_split_size) serve only large requests, and only when the
                # waste stays under max_non_split_rounding_size.
                max_split = self._max_split
                if size < max_split:
                    if block.size >= max_split:
                        block = None
                elif block.size >= size + self.config.max_non_split_rounding_size:
                    block = None
                if block is not None:
                    del keys[i]  # pool.remove(block), the key's place known
                    del blocks[block.addr]
            if block is None:
                block = self._new_block(pool, stream, size)

            # alloc_found_block
            seg = block.seg
            remaining_size = block.size - size
            # Whether to split (torch's shouldSplit)
            if pool.is_small or self.config.expandable_segments:
                split = remaining_size >= K_MIN_BLOCK_SIZE
            else:
                split = size < self._max_split and remaining_size > K_SMALL_SIZE
            if split:
                remaining = block
                addr = remaining.addr
                prev = remaining.prev
                block = _Block(addr, size, seg)
                block.prev = prev
                if prev is not None:
                    prev.next = block
                elif seg.head is remaining:
                    seg.head = block
                block.next = remaining
                remaining.prev = block
                remaining.addr = rest = addr + size
                remaining.size = remaining_size
                # pool.insert(remaining), written out (same stream: the key list is at hand)
                bisect.insort(keys, remaining_size << _ADDR_BITS | rest)
                pool.blocks[rest] = remaining
                remaining.gc_base = pool.free_calls
                if not seg.expandable:
                    if prev is not None or remaining.next is not None:  # it was split already
                        # An already-split inactive block shrinks by `size` (_dec, written out).
                        self._all_inactive_split_bytes.current -= size
                        stat = pool.inactive_split_bytes
                        stat.current -= size
                        stat.freed += size
                    else:
                        # A whole free segment becomes split: its remainder is now stranded
                        # (_inc of the bytes and the count, written out).
                        stat = self._all_inactive_split_bytes
                        current = stat.current = stat.current + remaining_size
                        if current > stat.peak:
                            stat.peak = current
                        stat = pool.inactive_split_bytes
                        current = stat.current = stat.current + remaining_size
                        if current > stat.peak:
                            stat.peak = current
                        stat.allocated += remaining_size
                        stat = self._all_inactive_split
                        current = stat.current = stat.current + 1
                        if current > stat.peak:
                            stat.peak = current
                        stat = pool.inactive_split
                        current = stat.current = stat.current + 1
                        if current > stat.peak:
                            stat.peak = current
                        stat.allocated += 1
            elif not seg.expandable and (block.prev is not None or block.next is not None):
                # A whole inactive split block is taken (_dec, written out).
                stranded = block.size
                self._all_inactive_split_bytes.current -= stranded
                stat = pool.inactive_split_bytes
                stat.current -= stranded
                stat.freed += stranded
                self._all_inactive_split.current -= 1
                stat = pool.inactive_split
                stat.current -= 1
                stat.freed += 1

            block.allocated = True
            block.requested = orig_size
            addr = block.addr
            self._active[addr] = block
            size = block.size
            # _inc of allocation (and active: the same counters), allocated_bytes (and
            # active_bytes) and requested_bytes, all pools' and the pool's, written out
            stat = self._all_allocation
            current = stat.current = stat.current + 1
            if current > stat.peak:
                stat.peak = current
            stat = pool.allocation
            current = stat.current = stat.current + 1
            if current > stat.peak:
                stat.peak = current
            stat.allocated += 1
            stat = self._all_allocated_bytes
            current = stat.current = stat.current + size
            if current > stat.peak:
                stat.peak = current
            stat = pool.allocated_bytes
            current = stat.current = stat.current + size
            if current > stat.peak:
                stat.peak = current
            stat.allocated += size
            stat = self._all_requested_bytes
            current = stat.current = stat.current + orig_size
            if current > stat.peak:
                stat.peak = current
            stat = pool.requested_bytes
            current = stat.current = stat.current + orig_size
            if current > stat.peak:
                stat.peak = current
            stat.allocated += orig_size
            if size >= self._max_split:
                self._oversize_allocations.inc(1)
            if frames is not None:
                self._frames[addr] = frames
            return addr
        except SimulatedOutOfMemoryError as exc:
            error, observed = exc, self._last_oom
        finally:
            self._lock.release()
        # As torch does: the observers run on the allocating thread, with the allocator's lock
        # released, before the error is raised (torch.cuda.memory's out-of-memory observers).
        for observer in list(self._oom_observers):
            observer(*observed)
        raise error

    @staticmethod
    def check_settings(conf: str) -> None:
        """ValueError where torch's parser would refuse `conf`."""
        AllocatorConfig.parse(conf)

    def set_settings(self, conf: str) -> None:
        """torch._C._accelerator_setAllocatorSettings in a running process: the whole string
        replaces the options (keys it leaves out go back to their defaults).  As in torch, it
        changes what the allocator does from the next request on: segments already cached keep
        their kind (a cudaMalloc'd segment stays one until empty_cache releases it), new ones
        are expandable where the option now says so."""
        config = AllocatorConfig.parse(conf)
        with self._lock:
            self._apply_config(config)

    def record_history(self, enabled: bool) -> None:
        """torch.cuda.memory._record_memory_history(enabled="state" or None, context="alloc",
        stacks="python"): from now on, each new block keeps its allocating frames, which the
        snapshot carries as torch does (`frames`, innermost first); off forgets them all."""
        with self._lock:
            self._history = bool(enabled)
            if not enabled:
                self._frames.clear()

    @property
    def history_enabled(self) -> bool:
        return self._history

    def attach_out_of_memory_observer(self, observer: Callable[[int, int, int, int], Any]) -> None:
        """torch._C._cuda_attach_out_of_memory_observer: `observer(device, alloc_size,
        memory limit (the per-process cap, else the device's total), device free bytes)` is
        called on every OOM."""
        self._oom_observers.append(observer)

    def free(self, address: int) -> None:
        """Return a block to the cache (free(0) is a no-op, like freeing a null pointer)."""
        if address == 0:
            return
        self._lock.acquire()  # not `with`: see malloc
        try:
            block = self._active.pop(address, None)
            if block is None:
                raise ValueError(f"{address:#x} is not an allocated block of this allocator")
            if self._frames:  # history on (or its frames not yet freed)
                self._frames.pop(address, None)
            seg = block.seg
            small = seg.is_small
            pool = self._small if small else self._large
            block.allocated = False
            size = block.size
            requested = block.requested
            # _dec of allocation (and active), allocated_bytes (and active_bytes) and
            # requested_bytes, all pools' and the pool's, written out
            self._all_allocation.current -= 1
            stat = pool.allocation
            stat.current -= 1
            stat.freed += 1
            self._all_allocated_bytes.current -= size
            stat = pool.allocated_bytes
            stat.current -= size
            stat.freed += size
            self._all_requested_bytes.current -= requested
            stat = pool.requested_bytes
            stat.current -= requested
            stat.freed += requested
            if size >= self._max_split:
                self._oversize_allocations.dec(1)

            # Freed blocks keep no request size (torch keeps a stale one; 0 reads better in a
            # snapshot, and no statistic depends on it).
            block.requested = 0
            # Coalesce with free neighbours (try_merge_blocks, written out: an allocated block is
            # mapped, so a free neighbour merges when it is mapped too).
            keys = pool.keys[block.stream]
            blocks = pool.blocks
            subsumed = 0  # bytes of the free blocks merged into this one
            merged = 0  # how many
            prev = block.prev
            nxt = block.next  # merging the block before leaves the one after in place
            if prev is not None and not prev.allocated and prev.mapped:
                # pool.remove(prev)
                key = prev.size << _ADDR_BITS | prev.addr
                i = bisect.bisect_left(keys, key)
                if i == len(keys) or keys[i] != key:
                    raise AssertionError(f"block {prev.addr:#x} is not in the pool")
                del keys[i]
                del blocks[prev.addr]
                block.addr = prev.addr  # [prev block]
                before = block.prev = prev.prev
                if before is not None:
                    before.next = block
                if seg.head is prev:
                    seg.head = block
                size += prev.size
                subsumed += prev.size
                merged += 1
            if nxt is not None and not nxt.allocated and nxt.mapped:
                key = nxt.size << _ADDR_BITS | nxt.addr
                i = bisect.bisect_left(keys, key)
                if i == len(keys) or keys[i] != key:
                    raise AssertionError(f"block {nxt.addr:#x} is not in the pool")
                del keys[i]
                del blocks[nxt.addr]
                after = block.next = nxt.next  # [block nxt]
                if after is not None:
                    after.prev = block
                size += nxt.size
                subsumed += nxt.size
                merged += 1
            block.size = size
            # pool.insert(block), written out
            addr = block.addr
            bisect.insort(keys, size << _ADDR_BITS | addr)
            blocks[addr] = block
            block.gc_base = pool.free_calls
            # As in torch, expandable segments stay out of inactive_split: their free pages can
            # always be unmapped, so they are not the stranded memory the statistic is about.
            if seg.expandable:
                return
            if block.prev is not None or block.next is not None:  # block.is_split()
                net_blocks = 1 - merged
                net_bytes = size - subsumed
            else:
                net_blocks = -merged
                net_bytes = -subsumed
            # The net change of the stranded blocks and bytes: a call each (not written out as
            # malloc's are: a free changes them only when it frees into a split segment).
            if net_blocks > 0:
                self._inc(self._inactive_split, pool.is_small, net_blocks)
            elif net_blocks < 0:
                self._dec(self._inactive_split, pool.is_small, -net_blocks)
            if net_bytes > 0:
                self._inc(self._inactive_split_bytes, pool.is_small, net_bytes)
            elif net_bytes < 0:
                self._dec(self._inactive_split_bytes, pool.is_small, -net_bytes)
        finally:
            self._lock.release()

    def empty_cache(self) -> int:
        """Release every wholly free cached segment (and free expandable pages) to the device.

        Returns the number of bytes released."""
        # A segment a cudaFree: published to a shared GPU's ledger in one write (a trainer's
        # cache is ~150 segments after its first step).  The batch first, then the lock: the
        # order of a trainer's step (a batch in which each malloc takes the lock).
        with published_once(self.device), self._lock:
            before = self._total_allocated_memory
            self._release_cached_blocks()
            return before - self._total_allocated_memory

    def memory_stats(self) -> dict[str, int]:
        """torch.cuda.memory_stats(): a flat dict with torch's keys, sorted as torch sorts them."""
        with self._lock:
            out: dict[str, int] = {}
            for name, (every, small, large) in self._stats.items():
                prefix = f"{name}.all."
                out[prefix + "current"] = every.current
                out[prefix + "peak"] = every.peak
                out[prefix + "allocated"] = small.allocated + large.allocated
                out[prefix + "freed"] = small.freed + large.freed
                for pool_key, stat in (("small_pool", small), ("large_pool", large)):
                    prefix = f"{name}.{pool_key}."
                    out[prefix + "current"] = stat.current
                    out[prefix + "peak"] = stat.peak
                    out[prefix + "allocated"] = stat.allocated
                    out[prefix + "freed"] = stat.freed
            for name, stat in (
                ("oversize_allocations", self._oversize_allocations),
                ("oversize_segments", self._oversize_segments),
            ):
                out[name + ".current"] = stat.current
                out[name + ".peak"] = stat.peak
                out[name + ".allocated"] = stat.allocated
                out[name + ".freed"] = stat.freed
            out.update(self._counters)
            out["max_split_size"] = (
                self.config.max_split_size
                if self.config.max_split_size is not None
                else _UNSET_MAX_SPLIT_SIZE
            )
        return dict(sorted(out.items()))

    def memory_snapshot(self) -> list[dict[str, Any]]:
        """torch.cuda.memory_snapshot(): the segments, in address order."""
        with self._lock:
            return self._segments_snapshot()

    def snapshot(self) -> dict[str, Any]:
        """torch.cuda.memory._snapshot(): what torch.cuda._memory_viz and memory_viz read."""
        with self._lock:
            segments = self._segments_snapshot()
        c = self.config
        settings: dict[str, Any] = {
            "PYTORCH_CUDA_ALLOC_CONF": c.raw,
            "max_split_size": (
                c.max_split_size if c.max_split_size is not None else _UNSET_MAX_SPLIT_SIZE
            ),
            "garbage_collection_threshold": c.garbage_collection_threshold,
            "expandable_segments": c.expandable_segments,
            "pinned_num_register_threads": c.pinned_num_register_threads,
            "release_lock_on_cudamalloc": c.release_lock_on_cudamalloc,
            "pinned_use_cuda_host_register": c.pinned_use_cuda_host_register,
            "roundup_power2_divisions": {
                str(1 << k): d for k, d in enumerate(c.roundup_power2_divisions)
            },
        }
        return {"segments": segments, "device_traces": [[]], "allocator_settings": settings}

    def reset_peak_memory_stats(self) -> None:
        with self._lock:
            for stats in self._stats.values():
                for stat in stats:
                    stat.peak = stat.current
            self._oversize_allocations.peak = self._oversize_allocations.current
            self._oversize_segments.peak = self._oversize_segments.current

    def reset_accumulated_memory_stats(self) -> None:
        with self._lock:
            for stats in self._stats.values():
                for stat in stats:
                    stat.allocated = stat.freed = 0
            for stat in (self._oversize_allocations, self._oversize_segments):
                stat.allocated = stat.freed = 0
            for name in self._counters:
                self._counters[name] = 0

    def set_memory_fraction(self, fraction: float) -> None:
        """torch.cuda.set_per_process_memory_fraction: cap this allocator at fraction*total."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"invalid fraction {fraction}, must be in [0, 1]")
        with self._lock:
            self._set_fraction(fraction)

    def mem_get_info(self) -> tuple[int, int]:
        """torch.cuda.mem_get_info(): (free, total) bytes of the device."""
        return self.device.free_bytes(), self.device.total_bytes

    def memory_allocated(self) -> int:
        # A single attribute read is atomic under the GIL: no lock on the hot path.
        return self._allocated_bytes[0].current

    def allocated_counts(self) -> tuple[int, int, int]:
        """(allocated now, peak, bytes ever allocated): `allocated_bytes.all.{current, peak,
        allocated}`, read without the lock like memory_allocated()."""
        every, small, large = self._allocated_bytes
        return every.current, every.peak, small.allocated + large.allocated

    def memory_reserved(self) -> int:
        return self._reserved_bytes[0].current

    def max_memory_allocated(self) -> int:
        return self._allocated_bytes[0].peak

    def max_memory_reserved(self) -> int:
        return self._reserved_bytes[0].peak

    def allocation_size(self, address: int) -> int:
        """The (rounded) size of the block allocated at `address`."""
        with self._lock:
            block = self._active.get(address)
            if block is None:
                raise ValueError(f"{address:#x} is not an allocated block of this allocator")
            return block.size

    # -- sizes ---------------------------------------------------------------------------------

    def round_size(self, size: int) -> int:
        if size < K_MIN_BLOCK_SIZE:
            return K_MIN_BLOCK_SIZE
        if self._power2_rounding:  # most settings have none: the lookup is skipped
            divisions = self.config.roundup_divisions_for(size)
            if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
                return _roundup_power2_next_division(size, divisions)
        return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE

    @staticmethod
    def allocation_size_for(size: int) -> int:
        """The segment size cudaMalloc'd for a rounded request that the cache cannot serve."""
        if size <= K_SMALL_SIZE:
            return K_SMALL_BUFFER
        if size < K_MIN_LARGE_ALLOC:
            return K_LARGE_BUFFER
        return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE

    # -- internals (called with the lock held) -------------------------------------------------

    def _apply_config(self, config: AllocatorConfig) -> None:
        """`config` in force, and what the hot path reads of it precomputed."""
        self.config = config
        self._power2_rounding = _rounds_to_power2_divisions(config)
        # No max_split_size: a bound no block reaches (an int, which compares faster than inf).
        self._max_split = (
            config.max_split_size if config.max_split_size is not None else _NO_MAX_SPLIT
        )
        self._update_gc_clock()

    def _set_fraction(self, fraction: float) -> None:
        self._allowed_max = int(fraction * self.device.total_bytes)
        self._update_gc_clock()

    def _update_gc_clock(self) -> None:
        # The GC's clock (and the GC) run only with a threshold and a memory fraction, as in
        # torch (set by the settings and by set_memory_fraction).
        self._gc = self._allowed_max is not None and self.config.garbage_collection_threshold > 0

    # A statistic's update on the rarer paths (segments, oversize and expandable blocks, the
    # GC); malloc and free write the same out in place.  The all-pools figure keeps current
    # and peak only (see _Stat).

    @staticmethod
    def _inc(stats: tuple[_Stat, _Stat, _Stat], small: bool, n: int) -> None:
        stat = stats[0]  # all pools: current and peak (see _Stat)
        current = stat.current = stat.current + n
        if current > stat.peak:
            stat.peak = current
        stat = stats[1] if small else stats[2]
        current = stat.current = stat.current + n
        if current > stat.peak:
            stat.peak = current
        stat.allocated += n

    @staticmethod
    def _dec(stats: tuple[_Stat, _Stat, _Stat], small: bool, n: int) -> None:
        stats[0].current -= n  # all pools: current (see _Stat)
        stat = stats[1] if small else stats[2]
        stat.current -= n
        stat.freed += n

    @staticmethod
    def _expandable_best_fit(pool: _Pool, keys: list[int], i: int) -> tuple[_Block, int]:
        """From the first block large enough (keys[i], in an expandable segment): the best fit
        and its place.  Best fit counts the unmapped space a free tail block can still grow
        into, so a larger free block may be a tighter fit than the first one found."""

        def expandable_size(b: _Block) -> int:
            nxt = b.next
            return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

        blocks = pool.blocks
        block = blocks[keys[i] & _ADDR_MASK]
        j = i + 1
        while block.seg.expandable and j < len(keys):
            candidate = blocks[keys[j] & _ADDR_MASK]
            if expandable_size(candidate) >= expandable_size(block):
                break
            block = candidate
            i = j
            j += 1
        return block, i

    def _new_block(self, pool: _Pool, stream: int, size: int) -> _Block:
        """A cache miss: a new segment (after the GC, freeing oversize blocks, then the whole
        cache and a retry, as torch does), else SimulatedOutOfMemoryError."""
        alloc_size = self.allocation_size_for(size)
        if self._gc:
            self._garbage_collect_cached_blocks()
        block = self._alloc_block(pool, stream, size, alloc_size, is_retry=False)
        if block is None and self._release_available_cached_blocks(pool, stream, size):
            block = self._alloc_block(pool, stream, size, alloc_size, is_retry=False)
        if block is None:
            self._release_cached_blocks()
            block = self._alloc_block(pool, stream, size, alloc_size, is_retry=True)
        if block is None:
            self._counters["num_ooms"] += 1
            limit = self._allowed_max
            self._last_oom = (
                self.device_index,
                alloc_size,
                limit if limit is not None else self.device.total_bytes,
                self.device.free_bytes(),
            )
            raise SimulatedOutOfMemoryError(self._oom_message(alloc_size))
        return block

    def _try_merge_blocks(self, dst: _Block, src: _Block | None, pool: _Pool) -> int:
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:  # [src dst]
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
            if dst.seg.head is src:
                dst.seg.head = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _alloc_block(
        self, pool: _Pool, stream: int, size: int, alloc_size: int, is_retry: bool
    ) -> _Block | None:
        """cudaMalloc a new segment (or map more of an expandable one); None when it fails."""
        if is_retry:
            self._counters["num_alloc_retries"] += 1
        if (
            self._allowed_max is not None
            and self._total_allocated_memory + alloc_size > self._allowed_max
        ):
            return None
        if self.config.expandable_segments:
            return self._try_allocate_expandable_block(pool, stream, size)
        if not self.device.try_reserve(alloc_size):
            return None
        seg = _Segment(
            self._va.alloc(alloc_size), alloc_size, stream, pool.is_small, False, alloc_size
        )
        block = _Block(seg.start, alloc_size, seg)
        seg.head = block
        self._segments[seg.start] = seg
        self._total_allocated_memory += alloc_size
        self._inc(self._segment, pool.is_small, 1)
        self._inc(self._reserved_bytes, pool.is_small, alloc_size)
        if alloc_size >= self._max_split:
            self._oversize_segments.inc(1)
        self._counters["num_device_alloc"] += 1
        return block

    def _release_available_cached_blocks(self, pool: _Pool, stream: int, size: int) -> bool:
        """With max_split_size set, free just enough oversize cached segments for `size`."""
        if self.config.max_split_size is None:
            return False
        key_size = max(size, self.config.max_split_size)
        keys = pool.keys[stream]
        i = bisect.bisect_left(keys, key_size << _ADDR_BITS)
        if (
            i == len(keys)
            or pool.blocks[keys[i] & _ADDR_MASK].seg.expandable
            or pool.blocks[keys[i] & _ADDR_MASK].is_split()
        ):
            # No single block is large enough: free oversize blocks, largest first.
            released = 0
            i -= 1
            while (
                released < key_size
                and i >= 0
                and keys[i] >> _ADDR_BITS >= self.config.max_split_size
            ):
                block = pool.blocks[keys[i] & _ADDR_MASK]
                i -= 1  # entries after i may move; those before it stay put
                if not block.seg.expandable and not block.is_split():
                    released += block.size
                    self._release_block(block, pool)
            return released >= key_size
        self._release_block(pool.blocks[keys[i] & _ADDR_MASK], pool)
        return True

    def _release_cached_blocks(self) -> None:
        # torch synchronizes the device here (to retire blocks awaiting stream events).
        self._counters["num_sync_all_streams"] += 1
        self._release_blocks(self._large)
        self._release_blocks(self._small)

    def _release_blocks(self, pool: _Pool) -> None:
        to_unmap: list[_Block] = []
        for block in list(pool.blocks.values()):
            if block.seg.expandable:
                to_unmap.append(block)
            elif not block.is_split():
                self._release_block(block, pool)
        for block in to_unmap:
            self._unmap_block(block, pool)
            if block.prev is None and block.next is None and not block.mapped:
                self._release_expandable_segment(block, pool)

    def _release_block(self, block: _Block, pool: _Pool) -> None:
        self._counters["num_device_free"] += 1
        self.device.release(block.size)
        self._total_allocated_memory -= block.size
        self._dec(self._segment, pool.is_small, 1)
        self._dec(self._reserved_bytes, pool.is_small, block.size)
        if block.size >= self._max_split:
            self._oversize_segments.dec(1)
        pool.remove(block)
        del self._segments[block.seg.start]
        self._va.free(block.seg.start, block.seg.size)

    def _garbage_collect_cached_blocks(self) -> None:
        """garbage_collection_threshold: free the oldest unsplit large cached segments."""
        assert self._allowed_max is not None
        threshold = int(self.config.garbage_collection_threshold * self._allowed_max)
        if self._total_allocated_memory <= threshold:
            return
        target = self._total_allocated_memory - threshold
        pool = self._large

        def age(b: _Block) -> int:
            return pool.free_calls - b.gc_base

        freeable = [b for b in pool.blocks.values() if not b.is_split() and not b.seg.expandable]
        total_age = float(sum(age(b) for b in freeable))
        reclaimed = 0
        while reclaimed < target and freeable:
            avg = total_age / len(freeable)
            victims = [b for b in freeable if age(b) >= avg]
            if not victims:
                break
            for b in victims:
                reclaimed += b.size
                total_age -= age(b)
                self._release_block(b, pool)
            freeable = [b for b in freeable if b not in victims]

    # -- expandable segments -------------------------------------------------------------------
    #
    # As in torch, each (pool, stream) gets a virtual range of 1.125 x the device's memory that
    # is mapped page by page (2 MiB pages for the small pool, 20 MiB for the large) as it fills
    # and unmapped by empty_cache().  Free space is one growing tail instead of stranded split
    # remainders.  Each contiguous mapped range shows as one segment in snapshots.  Not counted
    # in the `segment` statistic, which torch only bumps for cudaMalloc'd segments.

    def _find_expandable_block(self, pool: _Pool, stream: int, size: int) -> _Block:
        def allocatable(b: _Block | None) -> bool:
            return b is not None and not b.allocated

        def has_room(b: _Block | None) -> bool:
            total = 0
            while total < size and b is not None and allocatable(b):
                total += b.size
                b = b.next
            return total >= size

        for address in pool.unmapped_keys[stream]:
            candidate = pool.unmapped[address]
            if allocatable(candidate.prev):
                assert candidate.prev is not None
                candidate = candidate.prev
            if has_room(candidate):
                return candidate
        page = K_SMALL_BUFFER if pool.is_small else K_LARGE_BUFFER
        total = self.device.total_bytes
        va_size = -(-(total + total // 8) // page) * page
        seg = _Segment(self._va.alloc(va_size), va_size, stream, pool.is_small, True, page)
        block = _Block(seg.start, va_size, seg, mapped=False)
        seg.head = block
        self._segments[seg.start] = seg
        pool.insert_unmapped(block)
        return block

    def _map_block(self, to_map: _Block, size: int, pool: _Pool) -> bool:
        page = to_map.seg.page
        # Unmapped blocks are whole pages, so rounding up never runs past the block.
        mapped = min(-(-size // page) * page, to_map.size)
        if not self.device.try_reserve(mapped):
            return False
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = _Block(to_map.addr + mapped, to_map.size - mapped, to_map.seg, mapped=False)
            rest.prev = to_map
            rest.next = to_map.next
            if rest.next is not None:
                rest.next.prev = rest
            to_map.next = rest
            to_map.size = mapped
            pool.insert_unmapped(rest)
        self._try_merge_blocks(to_map, to_map.prev, pool)
        self._try_merge_blocks(to_map, to_map.next, pool)
        pool.insert(to_map)
        self._total_allocated_memory += mapped
        self._inc(self._reserved_bytes, pool.is_small, mapped)
        self._counters["num_device_alloc"] += 1
        return True

    def _try_allocate_expandable_block(self, pool: _Pool, stream: int, size: int) -> _Block | None:
        candidate = self._find_expandable_block(pool, stream, size)
        # candidate heads a run of free/unmapped blocks with room for `size`.
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size), pool):
            return None
        while candidate.size < size:
            nxt = candidate.next
            assert nxt is not None and not nxt.mapped
            if not self._map_block(nxt, min(size - candidate.size, nxt.size), pool):
                return None
            candidate = nxt  # it has absorbed the free block before it
        pool.remove(candidate)
        return candidate

    def _unmap_block(self, block: _Block, pool: _Pool) -> None:
        seg = block.seg
        page = seg.page
        offset = block.addr - seg.start
        begin = seg.start + -(-offset // page) * page
        end = seg.start + (offset + block.size) // page * page
        if begin >= end:
            return  # no whole page inside this free block
        pool.remove(block)
        if begin > block.addr:
            before = _Block(block.addr, begin - block.addr, seg)
            before.prev = block.prev
            if before.prev is not None:
                before.prev.next = before
            else:
                seg.head = before
            before.next = block
            block.prev = before
            pool.insert(before)
        block_end = block.addr + block.size
        if block_end > end:
            after = _Block(end, block_end - end, seg)
            after.next = block.next
            if after.next is not None:
                after.next.prev = after
            after.prev = block
            block.next = after
            pool.insert(after)
        block.addr = begin
        block.size = end - begin
        block.mapped = False
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.insert_unmapped(block)
        unmapped = end - begin
        self.device.release(unmapped)
        self._total_allocated_memory -= unmapped
        self._dec(self._reserved_bytes, pool.is_small, unmapped)
        self._counters["num_device_free"] += 1

    def _release_expandable_segment(self, block: _Block, pool: _Pool) -> None:
        pool.remove_unmapped(block)
        del self._segments[block.seg.start]
        self._va.free(block.seg.start, block.seg.size)

    # -- reporting -----------------------------------------------------------------------------

    def _oom_message(self, alloc_size: int) -> str:
        device_free = self.device.free_bytes()
        allocated = self._allocated_bytes[0].current
        reserved = self._reserved_bytes[0].current
        allowed_info = (
            f"{format_size(self._allowed_max)} allowed; " if self._allowed_max is not None else ""
        )
        return (
            f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. "
            f"GPU {self.device_index} has a total capacity of "
            f"{format_size(self.device.total_bytes)} of which {format_size(device_free)} is free. "
            f"{self._process_info()}{allowed_info}"
            f"Of the allocated memory {format_size(allocated)} is allocated by PyTorch, and "
            f"{format_size(reserved - allocated)} is reserved by PyTorch but unallocated."
            " If reserved but unallocated memory is large try setting"
            " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid"
            " fragmentation.  See documentation for Memory Management "
            " (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )

    def _process_info(self) -> str:
        # torch asks NVML for every process on the device; devices that can say who uses
        # what play NVML here.  Without it torch prints nothing, and so do we.
        usage_by_pid = getattr(self.device, "usage_by_pid", None)
        if not callable(usage_by_pid):
            return ""
        try:
            usage: dict[int, int] = usage_by_pid()
        except OSError:
            return ""
        me = getattr(self.device, "pid", None)
        parts = []
        for pid, used in usage.items():
            who = "Including non-PyTorch memory, this process" if pid == me else f"Process {pid}"
            parts.append(f"{who} has {format_size(used)} memory in use. ")
        return "".join(parts)

    def _segments_snapshot(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for start in sorted(self._segments):
            seg = self._segments[start]
            block = seg.head
            while block is not None:
                if not block.mapped:
                    block = block.next
                    continue
                # One entry per contiguous mapped run (a whole segment unless expandable).
                address = block.addr
                total = allocated = requested = 0
                blocks: list[dict[str, Any]] = []
                while block is not None and block.mapped:
                    blocks.append(
                        {
                            "address": block.addr,
                            "size": block.size,
                            "requested_size": block.requested,
                            "state": "active_allocated" if block.allocated else "inactive",
                            "frames": self._frames.get(block.addr, []) if block.allocated else [],
                        }
                    )
                    total += block.size
                    if block.allocated:
                        allocated += block.size
                        requested += block.requested
                    block = block.next
                out.append(
                    {
                        "device": self.device_index,
                        "address": address,
                        "total_size": total,
                        "allocated_size": allocated,
                        # No stream events are modelled, so active == allocated.
                        "active_size": allocated,
                        "requested_size": requested,
                        "stream": seg.stream,
                        "segment_type": "small" if seg.is_small else "large",
                        "segment_pool_id": (0, 0),
                        "is_expandable": seg.expandable,
                        "frames": [],
                        "blocks": blocks,
                    }
                )
        return out


def _rounds_to_power2_divisions(config: AllocatorConfig) -> bool:
    """Whether roundup_power2_divisions rounds any size (round_size asks only then)."""
    return any(divisions > 1 for divisions in config.roundup_power2_divisions)


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """roundup_power2_divisions: round up to the next of `divisions` steps between powers of 2."""
    if size <= 4 or divisions <= 1 or _is_pow2(size):
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step
