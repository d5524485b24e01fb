"""Floor readings: the lowest allocated bytes between two samples, for a process without steps.

A viewer samples an agent about once a second.  Without step marks (a server, a custom loop, an
evaluation job) the leak test judges the floor of those samples (memtop.diagnosis.leak), and
the lowest of n samples of a sawtooth lands about its height / n above its floor: slow leaks
rise less than a healthy series' sampled floor wanders (bench/leak_eval.py, `FLOOR_LIMIT`).
So while a viewer watches such a process, the agent thread reads each device's allocated bytes
about `READING_INTERVAL_S` apart, between the samples, and keeps per connection the lowest
since its previous `sample`; the sample carries it (`allocated_floor_bytes`, with
`floor_readings`, how many reads it is the lowest of).

What it costs the trainer, and when it stops:
- one host-side allocator read per device (`Probe.memory_allocated`, marked any_thread: the
  same counters `sample` reads; no tensor, no device-runtime call), ~10 times a second, on the
  agent's own selector loop (no thread of its own: the loop's select timeout wakes it);
- only while a connection sampled within `VIEWER_WINDOW_S` (no viewer, no reads), and only while
  no step ended within `QUIET_STEPS_S` (a trainer that steps has step marks: the per-step
  baseline needs none of this);
- bounded state: per connection, one (lowest, count) per device of its last sample (at most
  `MAX_DEVICES`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memtop.agent.boundary import StepBoundary
    from memtop.agent.probe import Probe

READING_INTERVAL_S = 0.1  # ~10 reads between two samples of a dashboard at 1 Hz
VIEWER_WINDOW_S = 3.0  # a connection that sampled within this long is watching
QUIET_STEPS_S = 10.0  # no step ended for this long (or none ever): the process has no steps
MAX_DEVICES = 16


class FloorState:
    """One connection's floor readings since its previous `sample`: by device index, the
    lowest allocated read and how many reads it is the lowest of."""

    __slots__ = ("lowest", "sampled_at")

    def __init__(self) -> None:
        self.sampled_at: float | None = None  # monotonic time of its last sample
        self.lowest: dict[int, tuple[int, int]] = {}

    def take(self, index: int, allocated_now: int) -> tuple[int, int] | None:
        """(lowest, reads) of device `index` for a sample whose own read is `allocated_now`
        (counted among the reads), or None when no floor reading was taken since the previous
        sample."""
        kept = self.lowest.get(index)
        if kept is None:
            return None
        return min(kept[0], allocated_now), kept[1] + 1

    def restart(self, now: float) -> None:
        """A sample was answered: the next one's floor starts from here."""
        self.lowest = {}
        self.sampled_at = now


class FloorReader:
    """The agent thread's floor readings (see the module's docstring)."""

    def __init__(self, probe: Probe, boundary: StepBoundary) -> None:
        self.probe = probe
        self.boundary = boundary
        self.indices: tuple[int, ...] = ()  # the devices of the newest sample
        self.next_at = 0.0
        self.reads = 0  # device reads taken, all told
        self.read_s = 0.0  # the agent thread's CPU they cost (thread_time)

    def devices_sampled(self, indices: Iterable[int]) -> None:
        self.indices = tuple(indices)[:MAX_DEVICES]

    def wanted(self, states: Iterable[FloorState], now: float) -> list[FloorState]:
        """The connections whose viewer watches a process without steps now (none: no reads)."""
        if not self.indices or self.boundary.stepping(QUIET_STEPS_S):
            return []
        return [
            state
            for state in states
            if state.sampled_at is not None and now - state.sampled_at <= VIEWER_WINDOW_S
        ]

    def due_in(self, states: Iterable[FloorState], now: float) -> float | None:
        """Seconds until the next reading is due (None: none is wanted)."""
        if not self.wanted(states, now):
            return None
        return max(0.0, self.next_at - now)

    def read_if_due(self, states: Iterable[FloorState], now: float) -> None:
        """Read each device's allocated once and lower every watching connection's floor."""
        if now < self.next_at:
            return
        watching = self.wanted(states, now)
        if not watching:
            return
        started = time.thread_time()
        self.next_at = now + READING_INTERVAL_S
        for index in self.indices:
            allocated = int(self.probe.memory_allocated(index))
            self.reads += 1
            for state in watching:
                kept = state.lowest.get(index)
                if kept is None:
                    state.lowest[index] = (allocated, 1)
                else:
                    state.lowest[index] = (min(kept[0], allocated), kept[1] + 1)
        self.read_s += time.thread_time() - started
