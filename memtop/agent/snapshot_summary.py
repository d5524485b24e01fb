"""The per-device summary a `snapshot` reply carries (DESIGN §4): memtop.segments' figures.

Kept as its own name in the agent so the server reads as what it does; the computation lives in
`memtop.segments`, shared with the viewer.
"""

from __future__ import annotations

from memtop.segments import summarize_segments as summarize_snapshot

__all__ = ["summarize_snapshot"]
