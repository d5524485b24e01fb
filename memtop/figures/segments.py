"""Figures of a snapshot in torch's segment/block format (`torch.cuda.memory_snapshot()`).

Pure functions over plain data, shared by both sides: the agent (inside the trainer) summarises
the snapshot it took, and the viewer's diagnosis reads the summary.  It sits below both, with
the model, so neither has to import the other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from memtop.figures.units import MiB

__all__ = ["SMALL_REQUEST_BYTES", "summarize_segments"]

SMALL_REQUEST_BYTES = 1 * MiB  # torch serves requests up to this size from the small pool


def summarize_segments(segments: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per device (keyed by its index as a string, as on the wire): the figures of one
    `torch.cuda.memory_snapshot()` segment list.  A pure function, for the agent's `snapshot`
    reply and for offline checks; every figure can be recomputed with torch's own
    `torch.cuda._memory_viz` helpers (tests/test_fragmentation.py does, on real H100 snapshots).

    - `reserved_bytes`, `allocated_bytes` (blocks in state active_allocated), `segments`;
    - `reserved_large_bytes`: segments of the large pool;
    - `stranded_bytes`: inactive blocks in large-pool segments that also hold a live block — the
      memory a split strands, usable only by requests that fit those gaps.  Wholly free segments
      are not counted (any request up to their size reuses them, and empty_cache returns them);
      nor are expandable segments (they grow in place and unmap free pages; torch counts no
      inactive split bytes for them either).  It is what torch's
      `inactive_split_bytes.large_pool.current` counts, measured from the blocks;
    - `largest_stranded_bytes`: the largest of those blocks;
    - `largest_request_bytes`: the largest request the cache serves without a new cudaMalloc:
      the largest inactive block of the large pool (whole free segments included), or with
      none, the largest small-pool block up to 1 MiB;
    - `external_fragmentation`: stranded / reserved large bytes (0 with nothing reserved);
    - `inactive_large_bytes`, `largest_inactive_large_bytes`: all inactive large-pool bytes and
      the largest such block (the figures of the old summary, kept for older viewers).
    """
    out: dict[str, dict[str, Any]] = {}
    for seg in segments:
        dev = out.setdefault(
            str(seg.get("device", 0)),
            {
                "segments": 0,
                "reserved_bytes": 0,
                "allocated_bytes": 0,
                "reserved_large_bytes": 0,
                "stranded_bytes": 0,
                "largest_stranded_bytes": 0,
                "largest_request_bytes": 0,
                "inactive_large_bytes": 0,
                "largest_inactive_large_bytes": 0,
                "_largest_small": 0,
            },
        )
        total = _int(seg.get("total_size"))
        dev["segments"] += 1
        dev["reserved_bytes"] += total
        large = seg.get("segment_type", "large") == "large"
        blocks = [b for b in seg.get("blocks", ()) if isinstance(b, Mapping)]
        free = [_int(b.get("size")) for b in blocks if b.get("state") == "inactive"]
        dev["allocated_bytes"] += sum(
            _int(b.get("size")) for b in blocks if b.get("state") == "active_allocated"
        )
        if not large:
            dev["_largest_small"] = max(dev["_largest_small"], *free, 0)
            continue
        dev["reserved_large_bytes"] += total
        dev["inactive_large_bytes"] += sum(free)
        dev["largest_inactive_large_bytes"] = max(dev["largest_inactive_large_bytes"], *free, 0)
        live = len(free) < len(blocks)  # some block is allocated (or awaiting its free)
        if live and free and not seg.get("is_expandable", False):
            dev["stranded_bytes"] += sum(free)
            dev["largest_stranded_bytes"] = max(dev["largest_stranded_bytes"], *free)
    for dev in out.values():
        small = min(dev.pop("_largest_small"), SMALL_REQUEST_BYTES)
        dev["largest_request_bytes"] = dev["largest_inactive_large_bytes"] or small
        reserved_large = dev["reserved_large_bytes"]
        dev["external_fragmentation"] = (
            dev["stranded_bytes"] / reserved_large if reserved_large else 0.0
        )
    return out


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0
