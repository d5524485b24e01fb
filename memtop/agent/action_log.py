"""The actions this agent performed in its trainer, whoever asked (issue 34): a small bounded log
served to every viewer the way step marks are (DESIGN §13), so an action taken by `memtop
cleanup PID` in another shell, by another dashboard or by the exporter's host is known to all.

Each entry: the command, its arguments (bounded), the wall time and the step it ran at, who
asked (the client's uid and pid from SO_PEERCRED on its connection), and the result (`ok`, or
`refused` with the error's code and message).  Appended where the action runs or is refused:
on the trainer's thread at the step boundary (cleanup, tune), on the worker (a snapshot file),
on the agent thread (reset_peak, stacks switched, a refusal).  The entry is built outside the
lock; under it, a counter bump and one `deque.append` (a reader copies at most 96 pairs under
it): a few hundred nanoseconds, nothing that can block for longer or raise into the trainer.
The lock makes numbering and appending one step, so a reader never moves its cursor past an
entry another thread numbered but had not appended yet.

Refusals are kept apart from what was done: a viewer that asks for cleanups twenty times a
second is refused twenty times a second, and must not push the cleanups that ran out of the log.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Mapping
from typing import Any

from memtop.protocol import replies

DONE_KEPT = 16  # actions that ran, newest kept, per command (reset_peak has no cooldown: a
# viewer that resets peaks in a loop must not push the last tune out of the log)
REFUSED_KEPT = 32  # refusals, newest kept (a separate bound: a flood evicts only its own kind)
ARG_TEXT = 200  # a string argument (a snapshot's path) is cut here
ARG_KEYS = 8  # at most this many arguments, each nested object too
WHY_TEXT = 300


def _bounded(value: Any, depth: int = 0) -> Any:
    """An argument as the log keeps it: scalars, short strings, small objects of them."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return value[:ARG_TEXT]
    if isinstance(value, Mapping) and depth < 2:
        return {str(k)[:64]: _bounded(v, depth + 1) for k, v in list(value.items())[:ARG_KEYS]}
    if isinstance(value, list | tuple) and depth < 2:
        return [_bounded(v, depth + 1) for v in value[:ARG_KEYS]]
    return str(value)[:ARG_TEXT]


class ActionLog:
    """The bounded log; `append` from any thread, `since` from the agent thread."""

    def __init__(self, done_kept: int = DONE_KEPT, refused_kept: int = REFUSED_KEPT) -> None:
        self._lock = threading.Lock()
        self.last_seq = 0  # the newest entry's number (read by `since` to skip the common case)
        self._done_kept = done_kept
        # Per command: the closed command set bounds how many deques there are.
        self.done: dict[str, collections.deque[tuple[int, dict[str, Any]]]] = {}
        self.refused: collections.deque[tuple[int, dict[str, Any]]] = collections.deque(
            maxlen=refused_kept
        )

    def append(
        self,
        cmd: str,
        args: Mapping[str, Any] | None,
        *,
        uid: int | None,
        pid: int | None,
        step: int | None,
        when: float | None = None,
        refused: tuple[str, str] | None = None,
        outcome: Mapping[str, Any] | None = None,
        figures: Mapping[str, Mapping[str, int]] | None = None,
    ) -> int:
        """Log one action (`refused`: its error's code and message); its sequence number."""
        entry = replies.action_entry(
            cmd=cmd,
            args=_bounded(dict(args or {})),
            time=time.time() if when is None else when,
            step=step,
            uid=uid,
            pid=pid,
            refused=None if refused is None else (refused[0][:40], refused[1][:WHY_TEXT]),
            outcome=None if not outcome else _bounded(outcome),
            devices=figures,
        )
        with self._lock:
            kept = self.refused
            if refused is None:
                kept = self.done.get(cmd) or self.done.setdefault(
                    cmd, collections.deque(maxlen=self._done_kept)
                )
            self.last_seq = seq = self.last_seq + 1
            entry["seq"] = seq
            kept.append((seq, entry))
        return seq

    def since(self, cursor: int) -> tuple[list[dict[str, Any]], int]:
        """The entries newer than `cursor`, oldest first, and the new cursor.  A viewer's first
        request (cursor 0) gets all that is still kept."""
        if self.last_seq <= cursor:  # the common case: nothing new, no lock taken
            return [], cursor
        with self._lock:
            last = self.last_seq
            pairs = [pair for kept in self.done.values() for pair in kept]
            pairs.extend(self.refused)
        taken = sorted((pair for pair in pairs if pair[0] > cursor), key=lambda pair: pair[0])
        return [entry for _, entry in taken], last
