"""Who owns a process and what it runs, and terminating one of the user's own processes.

The owner and command line of a pid do not change, so each pid is read from /proc (through
psutil) once and remembered until it leaves the view.  NVML can list pids of other containers
that this /proc does not show: those come back with an unknown owner and command.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from memtop.protocol import clean_text


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    pid: int
    uid: int | None  # None when the process is not visible here
    user: str | None
    cmdline: tuple[str, ...]  # cleaned of control characters (any user's argv may carry some)
    name: str
    # When the process started (psutil's create_time): tells a reused pid from the original.
    create_time: float | None = None

    @property
    def command(self) -> str:
        return " ".join(self.cmdline) if self.cmdline else self.name

    @property
    def visible(self) -> bool:
        return self.uid is not None


def read_process(pid: int) -> ProcessInfo:
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            uid = process.uids().real
            try:
                user: str | None = process.username()
            except (KeyError, psutil.Error):  # a uid with no passwd entry (containers)
                user = str(uid)
            try:
                cmdline = tuple(clean_text(a) for a in process.cmdline()[:256])
            except psutil.AccessDenied:
                cmdline = ()
            name = clean_text(process.name(), 100)
            created: float | None = process.create_time()
    except psutil.Error:
        return ProcessInfo(pid, None, None, (), "?")
    return ProcessInfo(pid, uid, user, cmdline, name, created)


class ProcessDirectory:
    """A per-pid cache of ProcessInfo, refreshed for pids it has not seen."""

    def __init__(self) -> None:
        self._known: dict[int, ProcessInfo] = {}

    def lookup(self, pids: Iterable[int]) -> dict[int, ProcessInfo]:
        wanted = set(pids)
        self._known = {pid: info for pid, info in self._known.items() if pid in wanted}
        for pid in wanted - self._known.keys():
            self._known[pid] = read_process(pid)
        return dict(self._known)


class TerminateRefused(Exception):
    """Why a process was not signalled, in one line."""


def terminate(pid: int, expected: ProcessInfo | None = None) -> str:
    """Send SIGTERM to one of the current user's own processes; returns what was done.

    `expected` is what the user saw when confirming: if the pid now runs something else (it
    exited and the number was reused), nothing is sent.
    """
    now = read_process(pid)
    if not now.visible:
        raise TerminateRefused(f"pid {pid} is gone (or not visible from here)")
    if now.uid != os.getuid():
        raise TerminateRefused(
            f"pid {pid} belongs to {now.user}: memtop terminates only your own processes"
        )
    if (
        expected is not None
        and expected.visible
        and (
            expected.cmdline != now.cmdline
            or (
                expected.create_time is not None
                and now.create_time is not None
                and abs(expected.create_time - now.create_time) > 0.01
            )
        )
    ):
        raise TerminateRefused(f"pid {pid} now runs something else; nothing sent")
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        raise TerminateRefused(f"pid {pid} exited before the signal") from None
    except PermissionError:
        raise TerminateRefused(f"not permitted to signal pid {pid}") from None
    return f"sent SIGTERM to pid {pid} ({now.name})"
