"""The thread-safe store of what the sampler read: latest values plus bounded history.

The sampler thread is the only writer, and it writes a round at a time (`Store.round()`): the
round's writes become visible together, as one generation.  Readers take `Store.view()`: one
immutable `RoundView` per generation, taken under one lock take, that the observation and the
diagnosis read and never query the store again.
History lives in bounded columns of doubles (`Ring`), so an hour of 8 GPUs × 8 agents at 1 Hz
costs a few MB and never grows.  A ring only appends (and compacts into new arrays), so the
round's view holds where each window's rows lie (`RingWindow`), not a copy of them: a reader
copies the rows it reads, when it reads them.
"""

from __future__ import annotations

import math
import threading
import time
from array import array
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any, overload

# Records only, from the model: the store (and the observation, the diagnosis and the UI above
# it) loads no protocol, socket, selector or psutil (issue 35); its writers parse the replies.
# AgentView and RoundView are the model's (the records this store keeps and hands out); they
# are named here too, for the readers that have always imported them here.
from memtop.model import (
    ACTION_BY_VIEWER,
    ACTION_FROM_AGENT,
    MARK_WINDOW,
    ActionRecord,
    AgentBreakdown,
    AgentSample,
    AgentSites,
    AgentSnapshot,
    AgentStatus,
    AgentView,
    DriverReading,
    PidFacts,
    ProcessInfo,
    RoundView,
    SiteUsage,
    StepMarks,
    host_of,
)

HISTORY_SAMPLES = 3600  # one hour at the default 1 s interval
# The step marks kept per agent device and per agent's host memory: as many as anything reads
# (the leak test, the screens, a report: the view's VIEW_MARKS).  It kept 4096, of which no
# reader saw more than the newest 1024: a trainer stepping a few times a second filled them
# in minutes, ~1.6 MB more in the `mixed` demo (22 rings) that the dashboard grew by as it aged.
STEP_MARKS = MARK_WINDOW
SITES_READINGS = 32  # `sites` readings kept per agent (minutes at the sampler's rate)
# An agent serves its top 20 sites per device (memtop.agent.sites.TOP_SITES); one that mints new
# sites in every reply (1,000 each, the most a reply may hold) cost the exporter ~50 MB and
# ~0.1 s of CPU a round.  So a reading keeps its largest SITES_PER_DEVICE sites per device and
# SITES_KEPT in all, and an agent's readings hold at most SITES_KEPT distinct sites: the oldest
# readings go first (a churning agent gets a shorter trend, never a wrong newest reading).
SITES_PER_DEVICE = 32
SITES_KEPT = 256
# The step marks a view publishes per device: as many as the leak test and the screens look at.
VIEW_MARKS = MARK_WINDOW
# One agent device's sampled history; the pressure counters are kept so that their deltas over a
# window can be read back.
HISTORY_COLUMNS = (
    "time",
    "allocated",
    "reserved",
    "torch_peak",
    "fragmentation",
    "num_alloc_retries",
    "num_ooms",
    "split",  # inactive_split_bytes: an action's effect reads it (memtop.diagnosis.effects)
    # The agent's floor reading (the lowest allocated between samples, a process without
    # steps; NaN where the sample carried none): the leak test's time basis reads it.
    "allocated_floor",
)
ACTIONS_KEPT = 64  # the actions performed in trainers, newest kept
ACTION_COUNT_KEYS = 16  # (kind, result) pairs counted per agent; the rest count as "other"
REFUSALS_KEPT = 16  # ... and the refused ones apart (a flood of refusals evicts only its kind)


class Ring:
    """A table of float columns that keeps its newest `capacity` rows, append-only: a row, once
    written, is never written again, so the rows a round published (`Ring.published`, a
    `RingWindow` of where they lie) stay those rows, whatever the sampler writes after.

    The oldest rows go by compaction: once `capacity` + `slack` rows lie in the columns, they
    are replaced by new arrays of the newest rows (the old arrays stay as they were, for
    whoever holds a window of them).  Each compaction copies `capacity` rows once per `slack`
    appends (~16 values a row); the columns hold at most `slack` rows more than `capacity` (1/16:
    what an array's own growth reserves after a compaction, so it grows once a cycle).

    The columns grow with the rows until the capacity is reached: a trainer that lived four
    seconds holds four rows, not an hour's worth (~330 KiB an agent device, held through the
    exited row's minute: ~20 MB on a dashboard with a trainer arriving every second)."""

    __slots__ = ("_columns", "_first", "_slack", "capacity", "names")

    def __init__(self, capacity: int, names: Sequence[str]) -> None:
        self.capacity = capacity
        self.names = tuple(names)
        self._columns = [array("d") for _ in names]
        self._first = 0  # the oldest kept row's place in the columns
        self._slack = max(1, capacity // 16)

    def append(self, *values: float) -> None:
        columns = self._columns
        if len(columns[0]) - self._first >= self.capacity:  # full: the oldest row goes
            self._first += 1
            if self._first >= self._slack:
                # New arrays, never the published ones written over (RingWindow).
                columns = self._columns = [column[self._first :] for column in columns]
                self._first = 0
        for column, value in zip(columns, values, strict=True):
            column.append(value)

    def extend(self, *columns: array[float]) -> None:
        """Many rows at once, a column each (equally long), as that many `append`s would leave
        the ring: the newest `capacity` rows kept, a compaction into new arrays once the
        oldest gone reach `slack`.  A connection's first sample (an agent's 1,024 step marks)
        costs one C call a column, not a call a row."""
        count = len(columns[0])
        if count == 0:
            return
        skip = max(0, count - self.capacity)  # rows older than the newest `capacity` given
        self._first += max(0, len(self) + count - skip - self.capacity)
        if self._first >= self._slack:
            # New arrays, never the published ones written over (RingWindow); when `count`
            # replaces every kept row, compacted to nothing at all.
            self._columns = [column[min(self._first, len(column)) :] for column in self._columns]
            self._first = 0
        for column, values in zip(self._columns, columns, strict=True):
            column.extend(values[skip:] if skip else values)

    def __len__(self) -> int:
        return len(self._columns[0]) - self._first

    def column(self, name: str, last: int | None = None) -> list[float]:
        """Oldest first; `last` keeps only the newest rows."""
        return self.window(name, last).tolist()

    def window(self, name: str, last: int | None = None) -> array[float]:
        """`column` as a fresh array rather than a list: a copy of the bytes (memcpy), no float
        object per row until one is read."""
        data = self._columns[self.names.index(name)]
        return data[self._start(last) :]

    def published(self, last: int | None = None) -> RingWindow:
        """The newest rows (`last` of them, or all) where they lie, copying none: the round's
        view holds this, and a reader cuts from it what it reads (RingWindow)."""
        return RingWindow(
            self.names, tuple(self._columns), self._start(last), len(self._columns[0])
        )

    def _start(self, last: int | None) -> int:
        """Where the newest `last` rows (all: None) start in the columns."""
        end = len(self._columns[0])
        return self._first if last is None else max(self._first, end - max(0, last))

    def count_since(self, name: str, since: float) -> int:
        """How many of the newest rows have `name` >= since (the column must be ascending)."""
        data = self._columns[self.names.index(name)]
        return len(data) - bisect_left(data, since, self._first)

    def last(self, name: str) -> float | None:
        if not len(self):
            return None
        return self._columns[self.names.index(name)][-1]


class RingWindow(Mapping[str, "RingColumn"]):
    """Rows [start, stop) of a ring's columns as one round published them, by column name: what
    the round's view holds of each ring, nothing copied.  A reader cuts what it reads (a slice:
    a memcpy of those rows only).  Those rows are never written again (the ring only appends
    after them, and compacts into new arrays), so a reader of generation N never sees a row of
    N+1, and reads without the store's lock: under the GIL a reader's slice and the sampler's
    append to the same array are each one C call, never interleaved (an append that moves the
    array's memory moves the rows with it)."""

    __slots__ = ("_columns", "_names", "_start", "_stop")

    def __init__(
        self, names: tuple[str, ...], columns: tuple[array[float], ...], start: int, stop: int
    ) -> None:
        self._names = names
        self._columns = columns
        self._start = start
        self._stop = stop

    def __getitem__(self, name: str) -> RingColumn:
        try:
            data = self._columns[self._names.index(name)]
        except ValueError:
            raise KeyError(name) from None
        return RingColumn(data, self._start, self._stop)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"RingWindow({self._stop - self._start} rows of {', '.join(self._names)})"


class RingColumn(Sequence[float]):
    """One column of a `RingWindow`: a sequence of its rows, oldest first, read in place.  A
    slice is a fresh array of those rows (as a slice of an array is), an index one float."""

    __slots__ = ("_data", "_start", "_stop")

    def __init__(self, data: array[float], start: int, stop: int) -> None:
        self._data = data
        self._start = start
        self._stop = stop

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, key: int) -> float: ...

    @overload
    def __getitem__(self, key: slice) -> array[float]: ...

    def __getitem__(self, key: int | slice) -> float | array[float]:
        count = self._stop - self._start
        if isinstance(key, slice):
            first, end, step = key.indices(count)
            if step == 1:
                return self._data[self._start + first : self._start + max(first, end)]
            return self._data[self._start : self._stop][key]
        if key < 0:
            key += count
        if not 0 <= key < count:
            raise IndexError("RingColumn index out of range")
        return self._data[self._start + key]

    def __iter__(self) -> Iterator[float]:
        return iter(self._data[self._start : self._stop])

    def __reversed__(self) -> Iterator[float]:
        return reversed(self._data[self._start : self._stop])

    def tolist(self) -> list[float]:
        return self._data[self._start : self._stop].tolist()

    def search(self, value: float, right: bool = False) -> int:
        """`bisect_left` (`bisect_right` with `right`) of an ascending column, searched in its
        array at C speed: the bisect module would call `__getitem__` here once per probe
        (model.search_column)."""
        search = bisect_right if right else bisect_left
        return search(self._data, value, self._start, self._stop) - self._start

    def __repr__(self) -> str:
        return f"RingColumn({self.tolist()!r})"


@dataclass
class _Rings:
    """The writer's bookkeeping of one agent beside its record (`AgentView`, the one record the
    store keeps of it, replaced whole on each write): each device's history and step marks, its
    host memory's, the `sites` readings, and what its action log has told.  Readers never see
    these: `Store.view` publishes their windows (`Ring.published`) beside the round's records."""

    first_seen: float = field(default_factory=time.time)
    devices: dict[int, tuple[Ring, Ring]] = field(default_factory=dict)  # history, marks
    host_history: Ring | None = None
    host_marks: Ring | None = None
    # The agent's `sites` readings, oldest first (stack recording on): the leak's line.
    sites: deque[AgentSites] = field(default_factory=lambda: deque(maxlen=SITES_READINGS))
    # The newest action log number read from the agent: an entry at or below it was kept (or
    # was, and aged out) when a reconnection serves the whole log again.
    action_seq_seen: int = 0


class Store:
    def __init__(
        self,
        history: int = HISTORY_SAMPLES,
        step_marks: int = STEP_MARKS,
        keep_exited_s: float = 60.0,
    ) -> None:
        # Re-entrant: the writes of a round (`round()`) each take it again inside the round's.
        self._lock = threading.RLock()
        self._history = history
        self._step_marks = step_marks
        self._keep_exited_s = keep_exited_s
        self._nvml: DriverReading | None = None
        self._nvml_time: float | None = None
        self._device_used: dict[str, Ring] = {}
        # One record per agent, replaced whole on each write, and the writer's rings beside it.
        self._agents: dict[int, AgentView] = {}
        self._rings: dict[int, _Rings] = {}
        self._processes: dict[int, ProcessInfo] = {}
        self._owners: dict[int, PidFacts] = {}
        self._problems: list[str] = []
        self.events: deque[tuple[float, str]] = deque(maxlen=200)
        self._actions: deque[ActionRecord] = deque(maxlen=ACTIONS_KEPT)
        self._refusals: deque[ActionRecord] = deque(maxlen=REFUSALS_KEPT)
        # Bumped once per round (once per write outside one): the UI redraws only when it moved.
        self.generation = 0
        self._rounds_open = 0  # depth of `round()` on the thread that holds the lock
        self._changed_in_round = False
        self._view: RoundView | None = None  # the newest generation's view, once asked for

    # ------------------------------------------------------------------ rounds

    @contextmanager
    def round(self) -> Iterator[None]:
        """The writes of one round (a sampler's, a replay's seek, a fleet read), published
        together: no reader sees the store between them, and the generation moves once, at the
        end.  Do the round's I/O first: the lock is held throughout."""
        with self._lock:
            self._rounds_open += 1
            try:
                yield
            finally:
                self._rounds_open -= 1
                if not self._rounds_open and self._changed_in_round:
                    self._changed_in_round = False
                    self.generation += 1

    def _changed(self) -> None:
        """A write happened (the lock is held): a new generation now, or at the round's end."""
        if self._rounds_open:
            self._changed_in_round = True
        else:
            self.generation += 1

    # ------------------------------------------------------------------ writers (sampler)

    def reset(self) -> None:
        """Forget everything read so far (a replay that seeks back starts over).  The
        generation keeps counting up, so that no reader takes the old picture for the new."""
        with self._lock:
            self._nvml = None
            self._nvml_time = None
            self._device_used.clear()
            self._agents.clear()
            self._rings.clear()
            self._processes = {}
            self._owners = {}
            self._problems = []
            self.events.clear()
            # A replay that seeks back before an action must not know of it yet.
            self._actions.clear()
            self._refusals.clear()
            self._changed()

    def update_driver(self, reading: DriverReading, when: float | None = None) -> None:
        when = when if when is not None else time.time()
        with self._lock:
            if self._nvml is not None and self._nvml.error != reading.error and reading.error:
                self.events.append((when, reading.error))
            self._nvml = reading
            self._nvml_time = when
            for device in reading.devices:
                if device.used_bytes is None:
                    continue
                ring = self._device_used.get(device.uuid)
                if ring is None:
                    ring = self._device_used[device.uuid] = Ring(self._history, ("time", "used"))
                ring.append(when, float(device.used_bytes))
            self._changed()

    def update_agents(self, polls: Iterable[AgentView], when: float | None = None) -> None:
        """Keep each agent's record of this round: the pool's record itself, completed with what
        the store keeps across rounds (the previous record's figures, this round's sample and
        low-rate replies applied to them)."""
        when = when if when is not None else time.time()
        with self._lock:
            for poll in polls:
                self._apply_poll(poll, when)
            for pid, agent in list(self._agents.items()):
                expired = agent.last_sample_time or self._rings[pid].first_seen
                if agent.state == AgentStatus.EXITED and when - expired > self._keep_exited_s:
                    del self._agents[pid], self._rings[pid]
            self._changed()

    def _apply_poll(self, poll: AgentView, when: float) -> None:
        pid = poll.pid
        previous = self._agents.get(pid)
        if previous is None:
            self._rings[pid] = _Rings()
            if poll.state == AgentStatus.CONNECTED:
                self.events.append((when, f"{_agent_name(pid)} attached"))
            else:  # found hung, refused, …: said once, with why
                message = f"{_agent_name(pid)} {poll.state}"
                self.events.append((when, f"{message}: {poll.error}" if poll.error else message))
        elif previous.state != poll.state:
            message = f"{_agent_name(pid)} {poll.state}"
            self.events.append((when, f"{message}: {poll.error}" if poll.error else message))
        kept = _kept_figures(previous)
        if poll.hello is None:
            kept["hello"] = previous.hello if previous is not None else None
        settings = kept["allocator_settings"]
        if poll.hello is not None and (
            previous is None or poll.hello is not previous.hello or settings is None
        ):
            # A fresh hello only: the pool hands the one it read on connecting every round,
            # and after a change its settings are older than the samples'.
            settings = self._settings(pid, settings, poll.hello.allocator_settings, when)
        if poll.sample is not None:
            settings = self._settings(pid, settings, poll.sample.allocator_settings, when)
            self._apply_sample(pid, poll.sample, kept)
        kept["allocator_settings"] = settings
        # The low-rate replies that came with this round (stamped with its time).
        if poll.breakdown_reply is not None:
            kept.update(_breakdown_kept(poll.breakdown_reply, when) or {})
        if poll.snapshot_reply is not None:
            kept.update(_snapshot_kept(poll.snapshot_reply, when) or {})
        if poll.sites_reply is not None:
            kept["sites"] = self._sites_kept(pid, poll.sites_reply, kept["sites"])
        self._publish(_written(poll, kept))

    def _publish(self, agent: AgentView) -> None:
        """`agent` is the store's record of its pid from now on: never written again."""
        object.__setattr__(agent, "kept", True)
        self._agents[agent.pid] = agent

    def _settings(
        self, pid: int, current: str | None, settings: str | None, when: float
    ) -> str | None:
        """The allocator's settings in force, as the agent says; a change is an event."""
        if settings is None or settings == current:
            return current
        if current is not None:
            self.events.append(
                (
                    when,
                    f"{_agent_name(pid)} allocator settings: "
                    f"{current or '(default)'} → {settings or '(default)'}",
                )
            )
        return settings

    def _apply_sample(self, pid: int, sample: AgentSample, kept: dict[str, Any]) -> None:
        """`kept` (an agent's figures) with `sample` kept: its devices' newest samples (the
        parsed records, by reference) and peaks, their rows appended to the rings."""
        rings = self._rings[pid]
        counts = kept["action_counts"]
        for action in sample.actions:  # the agent's action log: the pid as this viewer knows it
            counts = self._keep_action(replace(action, pid=pid), counts)
        last_oom = kept["last_oom"]
        if sample.oom is not None and isinstance(sample.oom.get("last"), Mapping):
            last_oom = sample.oom["last"]
        devices = {d.index: d for d in kept["devices"]}
        peaks = dict(kept["sampled_peaks"])
        for device in sample.devices:
            if device.index not in devices:
                rings.devices[device.index] = (
                    Ring(self._history, HISTORY_COLUMNS),
                    Ring(self._step_marks, ("step", "time", "allocated")),
                )
            devices[device.index] = device  # the parsed record itself
            peaks[device.index] = max(peaks.get(device.index, 0), device.allocated)
            rings.devices[device.index][0].append(
                sample.time,
                float(device.allocated),
                float(device.reserved),
                float(device.torch_peak),
                device.fragmentation,
                float(device.num_alloc_retries),
                float(device.num_ooms),
                float(device.inactive_split),
                math.nan if device.allocated_floor is None else float(device.allocated_floor),
            )
        host_memory = kept["host_memory"]
        if sample.host_memory is not None:
            host_memory = sample.host_memory
            if rings.host_history is None:
                rings.host_history = Ring(self._history, ("time", "rss"))
            rings.host_history.append(sample.time, float(sample.host_memory.rss_bytes))
        # The step marks, a column at a time (a first sample's backlog: 1,024 marks an agent).
        marks = StepMarks.of(sample.step_marks)
        if marks.host_rss is not None:
            host_rows = marks.host_rows()
            if len(host_rows[0]):
                if rings.host_marks is None:
                    rings.host_marks = Ring(self._step_marks, ("step", "time", "rss"))
                rings.host_marks.extend(*host_rows)
        for index, column in marks.allocated.items():
            if index in devices:
                rings.devices[index][1].extend(*marks.device_rows(index))
                # (a mark without the device holds MISSING_FIGURE: below any peak)
                peaks[index] = max(peaks[index], max(column, default=0))
        kept.update(
            step=sample.step,
            last_oom=last_oom,
            last_sample_time=sample.time,
            devices=tuple(devices[index] for index in sorted(devices)),
            sampled_peaks=peaks,
            host_memory=host_memory,
            action_counts=counts,
        )

    def update_breakdown(self, pid: int, reply: AgentBreakdown, when: float | None = None) -> None:
        """Keep a `breakdown` reply outside an agent's poll (a recording, a scrape): bytes by
        role per device.  A raw reply is parsed by its reader (memtop.protocol.schema), as the
        live one was."""
        figures = _breakdown_kept(reply, when if when is not None else time.time())
        if figures is not None:
            self._update_agent(pid, lambda agent: replace(agent, **figures))

    def update_snapshot_summary(
        self, pid: int, reply: AgentSnapshot, when: float | None = None
    ) -> None:
        """Keep the per-device summary of a `snapshot` reply (no file written) outside an
        agent's poll (a recording)."""
        figures = _snapshot_kept(reply, when if when is not None else time.time())
        if figures is not None:
            self._update_agent(pid, lambda agent: replace(agent, **figures))

    def update_sites(self, pid: int, reply: AgentSites) -> None:
        """Keep a `sites` reply outside an agent's poll (a recording)."""

        def apply(agent: AgentView) -> AgentView:
            sites = self._sites_kept(pid, reply, agent.sites)
            return agent if sites is agent.sites else replace(agent, sites=sites)

        self._update_agent(pid, apply)

    def _sites_kept(
        self, pid: int, reply: AgentSites, current: tuple[AgentSites, ...]
    ) -> tuple[AgentSites, ...]:
        """An agent's `sites` readings with `reply` kept (a new grouping only: the same one
        read twice is kept once), after the agent's past rounds it carries (a connection's
        first reply, DESIGN §13) that are newer than the newest kept: one reply gives a trend;
        stack recording off forgets the readings.  `current` as it was when nothing is new."""
        sites = self._rings[pid].sites
        if not reply.enabled:
            sites.clear()
            return ()
        if reply.time is None or (sites and sites[-1].time == reply.time):
            return current
        for past in reply.history:
            newest = sites[-1].time if sites else None
            if past.time is not None and (newest is None or newest < past.time < reply.time):
                keep_sites(sites, past)
        # Kept without its history: a reading is one round.
        keep_sites(sites, replace(reply, history=()) if reply.history else reply)
        return tuple(sites)

    def _update_agent(self, pid: int, apply: Callable[[AgentView], AgentView]) -> None:
        with self._lock:
            agent = self._agents.get(pid)
            if agent is not None:
                self._publish(apply(agent))
                self._changed()

    def update_owners(self, owners: Mapping[int, PidFacts]) -> None:
        """What is known of each pid the driver charges (read by the sampler)."""
        with self._lock:
            if owners != self._owners:
                self._owners = dict(owners)
                self._changed()

    def update_processes(self, processes: dict[int, ProcessInfo]) -> None:
        """Owner and command line of every pid in view (read by the sampler)."""
        with self._lock:
            if processes != self._processes:
                self._processes = dict(processes)
                self._changed()

    def record_action(self, action: ActionRecord) -> None:
        """An action performed in a trainer, by this memtop or (from the agent's action log)
        anyone: its effect is read from the history around it (memtop.diagnosis.effects), and
        it is an event.  One action known twice (this memtop did it, then read it back from the
        log: the same `seq`) is kept once, with the agent's time and step."""
        with self._lock:
            agent = self._agents.get(action.pid)
            counts = self._keep_action(action, agent.action_counts if agent is not None else None)
            if agent is not None and counts is not None and counts is not agent.action_counts:
                self._publish(replace(agent, action_counts=counts))
            self._changed()

    def _keep_action(
        self, action: ActionRecord, counts: Mapping[tuple[str, str], int] | None
    ) -> Mapping[tuple[str, str], int] | None:
        """Keep `action` (once); its agent's action `counts` with it counted, or as they were
        when it was known already (None: an agent the store does not keep)."""
        kept = self._actions if action.ok else self._refusals
        rings = self._rings.get(action.pid) if counts is not None else None
        if action.seq is not None:
            for i, known in enumerate(kept):
                if known.pid == action.pid and known.seq == action.seq:
                    if action.source != known.source:
                        # Ours, read back (or read back first): the agent's time, step and
                        # who, and still ours.
                        agents = action if action.source == ACTION_FROM_AGENT else known
                        kept[i] = replace(agents, source=ACTION_BY_VIEWER)
                    return counts
            if rings is not None:
                if action.seq <= rings.action_seq_seen:
                    return counts  # read before and aged out here: a reconnection serves it again
                if action.source == ACTION_FROM_AGENT:
                    rings.action_seq_seen = action.seq
        kept.append(action)
        if counts is not None:
            counted = dict(counts)
            key = (action.kind, action.result)
            if key not in counted and len(counted) >= ACTION_COUNT_KEYS:
                key = ("other", action.result)  # a hostile agent's made-up kinds: bounded
            counted[key] = counted.get(key, 0) + 1
            counts = counted
        by = action.by_words()
        said = f"{action.kind} in pid {action.pid}" + (f" {by}" if by else "")
        if not action.ok:
            said += f" refused: {action.why}" if action.why else " refused"
        self.events.append((action.time, said))
        return counts

    def reset_peak(self, pid: int) -> None:
        """memtop's own peak restarts from the current value (the `r` key)."""
        with self._lock:
            agent = self._agents.get(pid)
            if agent is not None:
                self._publish(
                    replace(agent, sampled_peaks={d.index: d.allocated for d in agent.devices})
                )
                self._changed()

    def set_problems(self, problems: list[str]) -> None:
        """Standing conditions (an unsafe socket directory, say) shown until they clear."""
        with self._lock:
            for problem in problems:
                if problem not in self._problems:
                    self.events.append((time.time(), problem))
            if problems != self._problems:
                self._problems = list(problems)
                self._changed()

    def problems(self) -> list[str]:
        with self._lock:
            return list(self._problems)

    def note(self, message: str, when: float | None = None) -> None:
        with self._lock:
            self.events.append((when if when is not None else time.time(), message))
            self._changed()

    # ------------------------------------------------------------------ readers

    def view(self) -> RoundView:
        """The newest generation, whole, in one lock take (and once per generation: readers of
        one generation share its view)."""
        with self._lock:
            view = self._view
            if view is None or view.generation != self.generation:
                view = self._view = RoundView(
                    generation=self.generation,
                    driver=self._nvml,
                    device_used={
                        uuid: _used(ring.published()) for uuid, ring in self._device_used.items()
                    },
                    agents=tuple(self._agents[pid] for pid in sorted(self._agents)),
                    processes=dict(self._processes),
                    problems=tuple(self._problems),
                    events=tuple(self.events),
                    owners=dict(self._owners),
                    actions=tuple(sorted((*self._actions, *self._refusals), key=lambda a: a.time)),
                    device_windows={
                        (pid, index): (_windows(history), _windows(marks, VIEW_MARKS))
                        for pid, rings in self._rings.items()
                        for index, (history, marks) in rings.devices.items()
                    },
                    host_windows={
                        pid: (_windows(rings.host_history), _windows(rings.host_marks, VIEW_MARKS))
                        for pid, rings in self._rings.items()
                        if rings.host_history is not None or rings.host_marks is not None
                    },
                )
            return view

    def driver(self) -> DriverReading | None:
        with self._lock:
            return self._nvml

    def device_used_window(
        self, uuid: str, last: int | None = None
    ) -> tuple[array[float], array[float]]:
        """(times, used bytes) of one GPU as arrays (Ring.window), oldest first."""
        with self._lock:
            ring = self._device_used.get(uuid)
            if ring is None:
                return (array("d"), array("d"))
            return (ring.window("time", last), ring.window("used", last))

    def device_used_history(self, uuid: str, last: int | None = None) -> list[tuple[float, float]]:
        """(time, used bytes) rows of one GPU, oldest first."""
        return list(zip(*self.device_used_window(uuid, last), strict=True))

    def agents(self) -> list[AgentView]:
        """Each agent's record as kept (no windows: `view()` has them), by pid."""
        with self._lock:
            return [self._agents[pid] for pid in sorted(self._agents)]

    def agent(self, pid: int) -> AgentView | None:
        with self._lock:
            return self._agents.get(pid)

    def processes(self) -> dict[int, ProcessInfo]:
        with self._lock:
            return dict(self._processes)

    def history(
        self,
        pid: int,
        index: int,
        last: int | None = None,
        since: float | None = None,
        columns: Sequence[str] | None = None,
    ) -> dict[str, list[float]]:
        """HISTORY_COLUMNS of one agent device, oldest first: all rows, the newest `last`, or
        those sampled at or after `since` (whichever is fewer), and only `columns` if given."""
        with self._lock:
            rings = self._device_rings(pid, index)
            if rings is None:
                return {}
            ring = rings[0]
            if since is not None:
                recent = ring.count_since("time", since)
                last = recent if last is None else min(last, recent)
            return {name: ring.column(name, last) for name in (columns or ring.names)}

    def step_marks(
        self,
        pid: int,
        index: int,
        last: int | None = None,
        columns: Sequence[str] | None = None,
    ) -> dict[str, list[float]]:
        """Columns step/time/allocated (or only `columns`) of the per-step baselines, oldest
        first."""
        with self._lock:
            rings = self._device_rings(pid, index)
            if rings is None:
                return {}
            marks = rings[1]
            return {name: marks.column(name, last) for name in (columns or marks.names)}

    def _device_rings(self, pid: int, index: int) -> tuple[Ring, Ring] | None:
        rings = self._rings.get(pid)
        return rings.devices.get(index) if rings is not None else None


# The store's part of an agent's record: the fields of model.AgentView marked STORE_KEPT, carried
# from one round's record to the next and written into the next round's pool record.  Read from
# the record's own fields: a field added there with the mark is kept, with no list here to drift.
_KEPT = tuple(f.name for f in fields(AgentView) if f.metadata.get("store_kept"))


def _kept_figures(agent: AgentView | None) -> dict[str, Any]:
    """What the store keeps of `agent` (a new agent: nothing yet), by field name."""
    return {name: getattr(agent if agent is not None else _NOTHING_KEPT, name) for name in _KEPT}


_NOTHING_KEPT = AgentView(0, AgentStatus.CONNECTED)  # a record's defaults (never published)


def _written(poll: AgentView, figures: Mapping[str, Any]) -> AgentView:
    """The pool's `poll` with the store's `figures` written into it: the record itself, the one
    time a store keeps it (no reader has seen it: the thread that made it this round hands it
    to the store it writes, under that store's lock), a copy of it when a store kept it already
    (a recording's or a scrape's record handed again: a record a reader may hold is never
    written)."""
    if poll.kept:
        return replace(poll, **figures)
    for name, value in figures.items():
        object.__setattr__(poll, name, value)
    return poll


def _breakdown_kept(reply: AgentBreakdown, stamp: float) -> dict[str, Any] | None:
    """The figures a `breakdown` reply gives its agent's record: a copy of each device's bytes
    by role, measured at the agent's time (a breakdown is served until the next one is taken:
    its age is from then, not from when it was read); None while the agent is measuring."""
    if reply.pending:
        return None
    return {
        "breakdown": {index: dict(figures) for index, figures in reply.devices.items()},
        "breakdown_time": reply.time if reply.time is not None else stamp,
        "breakdown_step": reply.step,
    }


def _snapshot_kept(reply: AgentSnapshot, stamp: float) -> dict[str, Any] | None:
    """The figures a `snapshot` reply gives its agent's record: its per-device summary, stamped
    when read; None while the agent is measuring."""
    if reply.pending:
        return None
    return {
        "snapshot_summary": {index: dict(figures) for index, figures in reply.devices.items()},
        "snapshot_time": stamp,
    }


def _windows(ring: Ring | None, last: int | None = None) -> Mapping[str, Sequence[float]]:
    return ring.published(last) if ring is not None else {}


def _used(window: RingWindow) -> tuple[Sequence[float], Sequence[float]]:
    return (window["time"], window["used"])


def keep_sites(kept: deque[AgentSites], reading: AgentSites) -> None:
    """Append `reading` to an agent's `kept` readings within the bounds above (SITES_KEPT):
    its largest sites only, each site one object shared by every reading that names it, and
    the oldest readings dropped while the readings name more than SITES_KEPT sites."""
    per_device: dict[int, int] = {}
    largest: list[SiteUsage] = []
    for usage in sorted(reading.sites, key=lambda u: -u.bytes):
        if len(largest) == SITES_KEPT:
            break
        if per_device.get(usage.device, 0) < SITES_PER_DEVICE:
            per_device[usage.device] = per_device.get(usage.device, 0) + 1
            largest.append(usage)
    known = {usage.site: usage.site for old in kept for usage in old.sites}
    shared = tuple(
        usage if known.get(usage.site) is None else replace(usage, site=known[usage.site])
        for usage in largest
    )
    kept.append(replace(reading, sites=shared))
    named = {usage.site for usage in shared}
    newest_first = list(reversed(kept))
    keep = 1
    for old in newest_first[1:]:
        named.update(usage.site for usage in old.sites)
        if len(named) > SITES_KEPT:
            break
        keep += 1
    while len(kept) > keep:
        kept.popleft()


def _agent_name(pid: int) -> str:
    """ "agent 4102", or "agent 4102 on node-b" for another machine's (the fleet view)."""
    host = host_of(pid)
    return f"agent {pid} on {host}" if host else f"agent {pid}"
