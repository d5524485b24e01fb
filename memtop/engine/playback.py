"""Playback: a recording written into a store, as the sampler would have written it live.

`Player` stands where the `Sampler` stands: it owns the store's writes, through the same store
calls in the same order per thing read (process owners, then the driver reading, then the agent
polls and their low-rate replies).  The `Observer` built on the store and its diagnosis see
exactly what they would have seen at that moment of the run; their clock is the cursor.

The dashboard drives a Player like a Sampler (start, stop, pause, rounds) plus a time cursor:
`seek`, `step_by` and `speed`.  The recording is read as a stream (`Recording.stream`: memory
stays bounded however long it is); seeking back replays it from the start into a fresh store
state (a few thousand events take milliseconds; an hour of a fast trainer, seconds).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

from memtop.engine.feed import ActionReply, FeedLoop, refused
from memtop.engine.store import Store
from memtop.model import AgentHello, AgentStatus, AgentView, DriverReading
from memtop.sources.agents import CONNECTED, sanity_problem
from memtop.sources.replay import Recording, ReplayEvent

NO_DEVICES = "this recording holds no driver readings (agent wire recordings)"
SPEEDS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
TICK_S = 0.1


class Player(FeedLoop):
    """The replay's feed (memtop.engine.feed.Feed): the recording at a cursor that moves on by
    itself
    at `speed` until paused or at the end."""

    thread_name = "memtop-replay"
    failure_label = "replay"
    join_timeout_s = 2.0

    def __init__(self, store: Store, recording: Recording, interval: float = 1.0) -> None:
        super().__init__(store)
        self.recording = recording
        self.interval = interval
        self.cursor = recording.start  # unix time of the recording shown now
        self.speed = 1.0
        self._events = recording.stream()
        self._next: ReplayEvent | None = None  # the first event not yet applied
        self._advance()
        self._hellos: dict[int, AgentHello] = {}
        self._counters: dict[int, dict[str, int]] = {}
        self._lock = threading.RLock()
        self._last_tick = time.monotonic()
        if not recording.has_devices:
            store.update_driver(DriverReading(available=False, error=NO_DEVICES), recording.start)

    # ------------------------------------------------------------------ the cursor

    @property
    def offset(self) -> float:
        """Seconds since the recording's start."""
        return self.cursor - self.recording.start

    @property
    def at_end(self) -> bool:
        return self._next is None

    def _advance(self) -> None:
        self._next = next(self._events, None)

    def clock(self) -> float:
        """The Observer's clock: the cursor, not the wall."""
        return self.cursor

    def seek(self, when: float) -> None:
        """Show the recording as it was at unix time `when` (clamped to the recording)."""
        when = min(max(when, self.recording.start), self.recording.end)
        # The events up to the cursor are published as one round (one generation): a screen
        # refreshing meanwhile shows the moment before the seek or after it, never between.
        with self._lock, self.store.round():
            if when < self.cursor:
                self._restart()
            self.cursor = when
            self._apply_until(when)
            self.rounds += 1

    def seek_offset(self, seconds: float) -> None:
        self.seek(self.recording.start + seconds)

    def step_by(self, seconds: float) -> None:
        self.seek(self.cursor + seconds)

    def faster(self, up: bool) -> float:
        index = SPEEDS.index(self.speed) if self.speed in SPEEDS else SPEEDS.index(1.0)
        index = min(len(SPEEDS) - 1, index + 1) if up else max(0, index - 1)
        self.speed = SPEEDS[index]
        return self.speed

    def _restart(self) -> None:
        self.store.reset()
        self._events = self.recording.stream()
        self._advance()
        self._hellos.clear()
        self._counters.clear()
        if not self.recording.has_devices:
            self.store.update_driver(
                DriverReading(available=False, error=NO_DEVICES), self.recording.start
            )

    def read_to_end(self) -> None:
        """Read the rest of the recording without applying it, and stop there: a one-shot
        report (`memtop replay --once --at T`) then knows the whole recording's skipped lines
        (Recording.skipped_count) from this one reading instead of a second one from the start.
        The cursor stays where it is; nothing later can be shown."""
        with self._lock:
            for _ in self._events:
                pass
            self._next = None

    def _apply_until(self, when: float) -> None:
        while self._next is not None and self._next.t <= when:
            self._apply(self._next)
            self._advance()

    def _apply(self, event: ReplayEvent) -> None:
        store, pid = self.store, event.pid
        if event.kind == "nvml":
            store.update_driver(event.value, event.t)
        elif event.kind == "processes":
            store.update_processes(event.value)
        elif pid is None:
            return
        elif event.kind == "hello":
            self._hellos[pid] = event.value
            store.update_agents([AgentView(pid, CONNECTED, event.value)], event.t)
        elif event.kind == "sample":
            hello = self._hellos.get(pid)
            counters = self._counters.setdefault(pid, {})
            problem = sanity_problem(hello, event.value, None, counters)
            if problem is not None:  # the live viewer kept none of these numbers either
                poll = AgentView(pid, AgentStatus.INCONSISTENT, hello, error=problem)
            else:
                poll = AgentView(pid, CONNECTED, hello, sample=event.value)
            store.update_agents([poll], event.t)
        elif event.kind == "breakdown":
            store.update_breakdown(pid, event.value, event.t)
        elif event.kind == "snapshot":
            store.update_snapshot_summary(pid, event.value, event.t)
        elif event.kind == "sites":
            store.update_sites(pid, event.value)
        elif event.kind == "state":
            state, error = event.value
            store.update_agents(
                [AgentView(pid, state, self._hellos.get(pid), error=error)], event.t
            )

    # ------------------------------------------------------------------ as a Sampler

    def sample_once(self, budget: float | None = None) -> None:
        """One tick of playback: the cursor moves on by the wall time times the speed."""
        self.step_by(self.interval * self.speed)

    def start(self) -> None:
        self._last_tick = time.monotonic()  # the cursor moves from when playing starts
        super().start()

    def _period(self) -> float:
        return TICK_S

    def _round(self) -> None:
        now = time.monotonic()
        with self._lock:  # `pause` waits for a tick under way: none lands after it
            if not self._paused.is_set() and not self.at_end:
                self.step_by((now - self._last_tick) * self.speed)
            self._last_tick = now

    def pause(self, paused: bool) -> None:
        """Once `pause(True)` returns the cursor stays where it is (no tick lands after it)."""
        with self._lock:
            super().pause(paused)
            self._last_tick = time.monotonic()  # a resumed replay moves on from now

    @property
    def still(self) -> bool:
        """No later moment will come by itself: paused, or at the end of the recording."""
        return self._paused.is_set() or self.at_end

    def may_signal(self, pid: int) -> str | None:
        return "this is a replay: there is no process to signal"

    def act(
        self, pid: int, cmd: str, args: dict[str, Any] | None = None, timeout: float = 10.0
    ) -> concurrent.futures.Future[ActionReply]:
        return refused(pid, cmd, "this is a replay: there is no agent to act on")
