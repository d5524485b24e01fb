"""The seam between a feed and what shows it (DESIGN §2): the one face the dashboard and the CLI
see of whatever writes the store.

Three feeds stand behind it: the live `memtop.engine.sampler.Sampler`, the replay's
`memtop.engine.playback.Player` and the fleet's `memtop.engine.fleet.FleetSampler`; `StillFeed` is
a store
nobody writes while it is shown (a frozen picture).  The app asks a feed for the newest
observation (through the `Observer` it builds on its store), pauses it, asks it to act on a pid
(an agent command, or a signal) and gets an `ActionReply` back, and asks it which pids may be
signalled.  It never queries the store, the sources or the sampler itself (an import contract
says so).

A new agent command on a key touches the protocol (its reply parser), the agent (its handler)
and the app (the key and what it says of the reply): the feeds carry any command.
"""

from __future__ import annotations

import concurrent.futures
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from memtop.base.records import record
from memtop.engine.store import Store
from memtop.model import ProcessInfo

if TYPE_CHECKING:
    # Imported when an observer is made, not with the feed: the sampler imports this module,
    # and the dashboard's start reads the GPUs before the diagnosis is loaded (~40 ms of
    # imports: memtop.commands.watch, issue 35).
    from memtop.engine.observation import Observer

T = TypeVar("T")


@record(frozen=True, slots=True)
class ActionReply:
    """What an action on a pid came to: the agent's reply (as sent, and parsed into its model
    object), what a signal did, or why it failed (one line)."""

    pid: int
    command: str
    error: str | None = None  # why it failed; None when it did not
    wire: Mapping[str, Any] = field(default_factory=dict)  # the reply as the agent sent it
    parsed: object | None = None  # its model object (memtop.protocol.REPLY_PARSERS)
    message: str = ""  # what was done, in one line (a signal)

    @property
    def ok(self) -> bool:
        return self.error is None

    def parsed_as(self, kind: type[T]) -> T | None:
        """The parsed reply when it is a `kind` (AgentCleanup, AgentSnapshot, …), else None."""
        return self.parsed if isinstance(self.parsed, kind) else None


def refused(pid: int, command: str, why: str) -> concurrent.futures.Future[ActionReply]:
    """An action this feed does not carry, answered at once."""
    future: concurrent.futures.Future[ActionReply] = concurrent.futures.Future()
    future.set_result(ActionReply(pid, command, error=why))
    return future


class Feed(Protocol):
    """What the dashboard drives: the live sampler, the replay player, the fleet sampler."""

    # Rounds written so far (0: the first has not landed yet) and the store's generation.
    @property
    def rounds(self) -> int: ...

    @property
    def generation(self) -> int: ...

    # Called on the feed's thread after each round it writes (the dashboard draws it then).
    on_round: Callable[[], None] | None

    def observer(
        self, *, clock: Callable[[], float] = time.time, host: str | None, uid: int | None
    ) -> Observer:
        """The one observer of the dashboard on this feed (it keeps the leak verdicts): its
        `latest()` is the newest observation."""
        ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def pause(self, paused: bool) -> None: ...

    @property
    def paused(self) -> bool: ...

    @property
    def still(self) -> bool:
        """No later round comes by itself for now (paused, or a replay at its end)."""
        ...

    def act(
        self, pid: int, cmd: str, args: dict[str, Any] | None = None, timeout: float = 10.0
    ) -> concurrent.futures.Future[ActionReply]:
        """Run agent command `cmd` in `pid` off the caller's thread; the future never raises
        for the agent's or the connection's failures (the reply's `error` says them)."""
        ...

    def may_signal(self, pid: int) -> str | None:
        """Why `pid` must not be signalled from here (None: it may, after the owner check)."""
        ...

    def signal(self, pid: int, sig: signal.Signals, expected: ProcessInfo | None) -> ActionReply:
        """Signal one of the user's own processes, if `may_signal` allows and the pid still
        runs what the user saw (`expected`, its ProcessInfo); blocks briefly (a worker's)."""
        ...


class Recording(Protocol):
    """What a replay's header reads of its recording (memtop.sources.replay.Recording)."""

    @property
    def duration(self) -> float: ...


class PlaybackFeed(Feed, Protocol):
    """A feed with a time cursor: the replay's (memtop.engine.playback.Player).  The replay app
    drives
    it through this face, so the UI loads none of the recording's readers."""

    cursor: float  # unix time of the moment shown
    speed: float

    @property
    def recording(self) -> Recording: ...

    @property
    def offset(self) -> float: ...

    @property
    def at_end(self) -> bool: ...

    def clock(self) -> float: ...

    def step_by(self, seconds: float) -> None: ...

    def faster(self, up: bool) -> float: ...


class FeedLoop:
    """Start, pause and stop: the thread control every feed shares.  A subclass says what one
    round is (`_round`) and how long a round lasts (`_period`)."""

    thread_name = "memtop-feed"
    failure_label = "feed"  # how the status line names the feed when a round raised
    join_timeout_s = 5.0

    def __init__(self, store: Store) -> None:
        self.store = store
        self.rounds = 0
        # Called on the feed's thread after each round (the dashboard draws the round then, not
        # on a timer of its own that may land in the middle of the next one).
        self.on_round: Callable[[], None] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._paused = threading.Event()

    @property
    def generation(self) -> int:
        return self.store.generation

    def observer(
        self, *, clock: Callable[[], float] = time.time, host: str | None, uid: int | None
    ) -> Observer:
        from memtop.engine.observation import Observer

        return Observer(self.store, clock=clock, host=host, uid=uid)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()

    def _period(self) -> float:
        raise NotImplementedError

    def _round(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            deadline = time.monotonic() + self._period()
            if not self._paused.is_set():
                try:
                    self._round()
                except Exception as exc:  # keep the feed going; say what happened
                    self.store.note(f"{self.failure_label}: {type(exc).__name__}: {exc}")
            self._stop.wait(max(0.0, deadline - time.monotonic()))

    def pause(self, paused: bool) -> None:
        if paused:
            self._paused.set()
        else:
            self._paused.clear()

    @property
    def paused(self) -> bool:
        return self._paused.is_set()

    @property
    def still(self) -> bool:
        return self.paused

    def _stop_thread(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.join_timeout_s)

    def stop(self) -> None:
        self._stop_thread()

    def signal(self, pid: int, sig: signal.Signals, expected: ProcessInfo | None) -> ActionReply:
        # Only a pid this feed vouches for (memtop.engine.sampler.Sampler.may_signal); the others
        # refuse every pid, so the signal itself lives with the sampler.
        why = self.may_signal(pid)
        return ActionReply(pid, "signal", error=why or "this feed signals no process")

    def may_signal(self, pid: int) -> str | None:
        raise NotImplementedError


class StillFeed(FeedLoop):
    """A store nobody writes while it is shown (a frozen picture: the tests' and the
    screenshots'): one round, nothing to pause, nobody to act on."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.rounds = 1

    def start(self) -> None:
        pass

    def may_signal(self, pid: int) -> str | None:
        return None  # the kill dialog is shown as on a live screen; `signal` sends nothing

    def signal(self, pid: int, sig: signal.Signals, expected: ProcessInfo | None) -> ActionReply:
        return ActionReply(pid, "signal", error="this view is not live: it signals no process")

    def act(
        self, pid: int, cmd: str, args: dict[str, Any] | None = None, timeout: float = 10.0
    ) -> concurrent.futures.Future[ActionReply]:
        return refused(pid, cmd, "this view is not live: it cannot act on processes")


def still_feed(store: object) -> StillFeed:
    """The feed of a store handed to the dashboard without one (checked here: the app never
    names the store's type)."""
    if not isinstance(store, Store):
        raise TypeError(f"a Store is needed, not {type(store).__name__}")
    return StillFeed(store)
