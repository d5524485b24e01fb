"""How a training step's memory grows with its batch, fitted to the step as it ran.

One model, two users: `memtop estimate --from RECORDING` (the largest batch of a run, from its
own measured peak) and the dashboard's "room for a batch N× larger" suggestion.  A step's
memory at its peak is a part that does not grow with the batch (weights, optimizer state, the
baseline a step leaves) plus one that does (activations, the loss's logits); torch's caching
allocator reserves more than that peak, and the more the larger the step's transient tensors
(blocks freed by one phase are cached at sizes the next cannot use), so the cache's overhead is
counted as a share of the growing part, measured where the run was measured:

    peak(b)     = fixed + growing · b / b0
    reserved(b) = fixed + growing · b / b0 · (1 + cache_share)

Sequence length scales the growing part the same way at a fixed batch (b·s tokens) as long as
attention is fused (no s² score matrices stored), which is what torch and transformers default
to.  Pure arithmetic: no I/O.
"""

from __future__ import annotations

import math
from typing import Any

from memtop.base.records import record

# When the run's cache overhead cannot be measured (the dashboard's first seconds): the share
# measured on shared/traces/cuda-h100/healthy (see memtop.estimate.memory.CACHE_SHARE).
DEFAULT_CACHE_SHARE = 0.165


@record(frozen=True, slots=True)
class BatchModel:
    """A step's memory as a part that grows with the batch and one that does not, and the cache
    above it."""

    batch: float  # the measured batch (1 when only factors of it are asked)
    fixed_bytes: int  # what does not grow with the batch
    growing_bytes: int  # what the step adds at its peak, at the measured batch
    cache_share: float  # reserved above the peak, per byte of the growing part

    @classmethod
    def fit(
        cls, batch: float, peak_bytes: int, reserved_bytes: int | None, fixed_bytes: int
    ) -> BatchModel:
        """Fitted to one measured step: its peak, the cache's reserved bytes at (or after) it,
        and what does not grow with the batch."""
        growing = max(1, peak_bytes - fixed_bytes)
        if reserved_bytes is None or reserved_bytes < peak_bytes:
            share = DEFAULT_CACHE_SHARE
        else:
            share = (reserved_bytes - peak_bytes) / growing
        return cls(batch, fixed_bytes, growing, share)

    def peak_at(self, batch: float) -> int:
        return round(self.fixed_bytes + self.growing_bytes * batch / self.batch)

    def reserved_at(self, batch: float) -> int:
        return round(
            self.fixed_bytes + self.growing_bytes * batch / self.batch * (1 + self.cache_share)
        )

    def factor(self, limit_bytes: int) -> float:
        """How many times the measured batch fits under `limit_bytes` of reserved memory."""
        per_batch = self.growing_bytes * (1 + self.cache_share)
        return max(0.0, (limit_bytes - self.fixed_bytes) / per_batch)

    def largest_batch(self, limit_bytes: int) -> int:
        """The largest whole batch whose reserved bytes stay under `limit_bytes` (0: none)."""
        # A hair of tolerance: the measured batch itself at exactly its limit still fits.
        return max(0, math.floor(self.factor(limit_bytes) * self.batch + 1e-9))

    def as_dict(self) -> dict[str, Any]:
        return {
            "measured_batch": self.batch,
            "fixed_bytes": self.fixed_bytes,
            "activation_bytes_per_sample": round(self.growing_bytes / self.batch),
            "cache_share": round(self.cache_share, 4),
        }
