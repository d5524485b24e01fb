"""The per-device summary a `snapshot` reply carries (DESIGN §4): memtop.figures.segments' figures.

Kept as its own name in the agent so the server reads as what it does; the computation lives in
`memtop.figures.segments`, shared with the viewer.
"""

from __future__ import annotations

from memtop.figures.segments import summarize_segments as summarize_snapshot

__all__ = ["summarize_snapshot"]
