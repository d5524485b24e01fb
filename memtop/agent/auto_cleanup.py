"""Opt-in emergency cleanup (`memtop run --auto-cleanup`, or MEMTOP_AUTO_CLEANUP=1 in the
trainer's environment): when a device the trainer uses is at least 95 % full (the driver's
view: every process on it), `gc.collect()` + `empty_cache()` at the next step boundary, so a
neighbour - or this trainer's next, larger step - gets back what PyTorch cached and Python kept
alive in reference cycles.

Off by default: gc.collect() takes ~120 ms in a process that imported torch, and emptying the
cache costs the trainer cudaMalloc calls later.  So it runs on the trainer's thread at a step
boundary (DESIGN §6), reads the device (mem_get_info, a CUDA call) at most once a second, runs
at most once a minute and at most ON_DEMAND_MAX_SHARE of the trainer's time, says what it
released on stderr, and is listed in the OOM reports that follow.
"""

from __future__ import annotations

import collections
import gc
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memtop.figures.units import format_bytes

if TYPE_CHECKING:
    from memtop.agent.server import Agent

THRESHOLD = 0.95  # the seeds' emergency threshold
CHECK_INTERVAL_S = 1.0
MIN_INTERVAL_S = 60.0
MAX_SHARE = 0.002  # of wall time, however slow a cleanup turns out
ENV = "MEMTOP_AUTO_CLEANUP"


def wanted(environ: dict[str, str] | Any) -> bool:
    return str(environ.get(ENV, "")).strip().lower() in ("1", "true", "yes", "on")


class AutoCleanup:
    """A step-boundary hook: `boundary.on_boundary = AutoCleanup(agent)`."""

    def __init__(
        self,
        agent: Agent,
        threshold: float = THRESHOLD,
        check_interval_s: float = CHECK_INTERVAL_S,
        min_interval_s: float = MIN_INTERVAL_S,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.agent = agent
        self.threshold = threshold
        self.check_interval_s = check_interval_s
        self.min_interval_s = min_interval_s
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._check_due = 0.0
        self._ready_at = 0.0
        self.runs: collections.deque[dict[str, Any]] = collections.deque(maxlen=32)

    def __call__(self, now: float) -> None:
        """Trainer's thread, at a step boundary (StepBoundary catches what this raises)."""
        if now < self._check_due:
            return
        self._check_due = now + self.check_interval_s
        probe, boundary = self.agent.probe, self.agent.boundary
        if probe.is_capturing():
            return
        fullest = None
        for device in probe.devices():
            free, total = probe.mem_get_info(device.index)
            boundary.mem_info[device.index] = (free, total, now)  # viewers get it fresh too
            used = (total - free) / total if total else 0.0
            if fullest is None or used > fullest[1]:
                fullest = (device.index, used)
        if fullest is None or fullest[1] < self.threshold or now < self._ready_at:
            return
        self._clean(now, *fullest)

    def _clean(self, now: float, index: int, used: float) -> None:
        probe, boundary = self.agent.probe, self.agent.boundary
        started = time.perf_counter()
        indices = [d.index for d in probe.devices()]
        before = {i: probe.memory_stats(i).get("reserved_bytes.all.current", 0) for i in indices}
        collected = gc.collect()
        for i in indices:
            probe.empty_cache(i)
        after = {i: probe.memory_stats(i).get("reserved_bytes.all.current", 0) for i in indices}
        took = time.perf_counter() - started
        self._ready_at = now + max(self.min_interval_s, took / MAX_SHARE)
        released = {str(i): max(0, before[i] - after[i]) for i in indices}
        record = {
            "time": now,
            "step": boundary.step,
            "device": index,
            "device_used_share": round(used, 4),
            "released_bytes": released,
            "gc_collected": collected,
            "took_s": round(took, 4),
        }
        self.runs.append(record)
        self.agent.oom.cleanups.append(record)  # the next OOM report lists it
        # An action like any other, asked by nobody: `by` is null (the agent's own).
        self.agent.actions.append(
            "cleanup",
            {"auto": True},
            uid=None,
            pid=None,
            step=boundary.step,
            when=now,
            outcome={"released_bytes": released, "took_s": round(took, 4)},
        )
        self.log(
            f"memtop: GPU {index} at {used:.0%} after step {boundary.step}: gc.collect() + "
            f"empty_cache() released {format_bytes(sum(released.values()))} in {took:.2f} s "
            f"(--auto-cleanup; next no sooner than {self._ready_at - now:.0f} s from now)"
        )
