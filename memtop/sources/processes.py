"""Who owns a process and what it runs, and terminating one of the user's own processes.

The owner and command line of a pid do not change, so each pid is read from /proc (through
psutil) once and remembered until it leaves the view.  NVML can list pids of other containers
that this /proc does not show: those come back with an unknown owner and command.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace

import psutil

# ProcessInfo is a record of memtop.model (the store and the UI import it from there); named
# here too for the importers of old.
from memtop.model import ProcessInfo
from memtop.protocol.environment import ENGINE_ENVIRONMENT
from memtop.protocol.procfs import process_start_ticks, stat_fields
from memtop.protocol.text import clean_text


def read_process(pid: int) -> ProcessInfo:
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            uid = process.uids().real
            try:
                # A passwd entry is text from outside memtop too: inert like the command line.
                user: str | None = clean_text(process.username(), 64)
            except (KeyError, psutil.Error):  # a uid with no passwd entry (containers)
                user = str(uid)
            try:
                cmdline = tuple(clean_text(a) for a in process.cmdline()[:256])
            except psutil.AccessDenied:
                cmdline = ()
            name = clean_text(process.name(), 100)
            created: float | None = process.create_time()
            ppid: int | None = process.ppid()
            environ = _engine_environ(process)
    except psutil.Error:
        return ProcessInfo(pid, None, None, (), "?")
    except OSError as exc:  # EMFILE, ENFILE: psutil's /proc reads raise them as they are
        raise ProcessesUnreadable(
            f"cannot read processes: {exc.strerror or exc} (out of file descriptors? ulimit -n)"
        ) from None
    return ProcessInfo(
        pid,
        uid,
        user,
        cmdline,
        name,
        created,
        ppid,
        launcher_cmdline=_cmdline_of(ppid),
        engine_environ=environ,
    )


def _engine_environ(process: psutil.Process) -> dict[str, str]:
    """The ENGINE_ENVIRONMENT variables of a process's environment, where /proc lets this user
    read it (its own processes; all of them as root): reading a file, nothing run."""
    try:
        environ = process.environ()
    except (psutil.Error, OSError):
        return {}
    return {name: clean_text(environ[name], 64) for name in ENGINE_ENVIRONMENT if name in environ}


def _cmdline_of(pid: int | None) -> tuple[str, ...]:
    """A launcher's command line (bounded), or () when it cannot be read."""
    if not pid or pid <= 1:
        return ()
    try:
        return tuple(clean_text(a) for a in psutil.Process(pid).cmdline()[:256])
    except (psutil.Error, OSError):
        return ()


class ProcessesUnreadable(Exception):
    """/proc could not be read at all (no descriptor left): one line, and no process is
    taken for gone or for someone else's because of it."""


USAGE_EVERY_S = 3.0  # host CPU % and RSS: a slow column, re-read at most this often


# /proc/PID/stat's clock ticks per second and page size (its times and resident set).
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


class ProcessDirectory:
    """A per-pid cache of ProcessInfo, refreshed for pids it has not seen; host CPU % and RSS
    of the visible ones re-read every USAGE_EVERY_S, from one read of /proc/PID/stat each (the
    CPU % measured from the last read: its CPU time and when, kept per pid)."""

    def __init__(self) -> None:
        self._known: dict[int, ProcessInfo] = {}
        # pid -> (when it started, its CPU seconds, time.monotonic() then): the CPU baseline.
        self._cpu: dict[int, tuple[bytes, float, float]] = {}
        self._usage_at = 0.0
        # Why the last lookup could not read every process (one line), else None.
        self.problem: str | None = None

    def lookup(self, pids: Iterable[int]) -> dict[int, ProcessInfo]:
        wanted = set(pids)
        self._known = {pid: info for pid, info in self._known.items() if pid in wanted}
        self._cpu = {pid: cpu for pid, cpu in self._cpu.items() if pid in wanted}
        self.problem = None
        for pid in wanted - self._known.keys():
            try:
                self._known[pid] = read_process(pid)
            except ProcessesUnreadable as exc:
                # Not remembered: read again next round, once descriptors are free.
                self.problem = str(exc)
                break
        now = time.monotonic()
        if now - self._usage_at >= USAGE_EVERY_S:
            self._usage_at = now
            for pid, info in self._known.items():
                if info.visible:
                    self._known[pid] = self._usage(info)
        return dict(self._known)

    def _usage(self, info: ProcessInfo) -> ProcessInfo:
        """`info` with its CPU % (since the last read: None at the first) and resident set, as
        psutil's cpu_percent and memory_info gave them (the same /proc figures: utime + stime,
        and the resident pages of statm, which stat repeats), from one file read, not two and
        psutil's layers around them (11 trainers every 3 s: ~1 ms of the sampler's round)."""
        tail = stat_fields(info.pid)
        when = time.monotonic()
        if tail is None or len(tail) <= 21:
            return info  # gone, or not readable from here: as it was
        try:
            cpu_s = (int(tail[11]) + int(tail[12])) / _CLOCK_TICKS
            rss = int(tail[21]) * _PAGE_BYTES
        except ValueError:
            return info
        started = tail[19]
        last = self._cpu.get(info.pid)
        self._cpu[info.pid] = (started, cpu_s, when)
        cpu = None
        if last is not None and last[0] == started:  # the same process (a pid reused: not)
            elapsed = when - last[2]
            cpu = round((cpu_s - last[1]) / elapsed * 100, 1) if elapsed > 0 else 0.0
        return replace(info, cpu_percent=cpu, rss=rss)


class TerminateRefused(Exception):
    """Why a process was not signalled, in one line."""


def terminate(
    pid: int,
    expected: ProcessInfo | None = None,
    sig: signal.Signals = signal.SIGTERM,
    *,
    started: int | None = None,
) -> str:
    """Send `sig` (SIGTERM unless the user chose INT or KILL) to one of the current user's own
    processes; returns what was done.

    `expected` is what the user saw when confirming: if the pid now runs something else (it
    exited and the number was reused), nothing is sent.  `started`: when the process memtop
    verified as that pid started (protocol.process_start_ticks, read when its agent's
    connection passed its checks): a process that started at any other time is not it.

    The process is pinned first (a pidfd, Linux >= 5.3), then checked, then signalled through
    the pidfd: the checks and the signal are about one process, even if the pid is reused
    meanwhile.  Without pidfds, the checks come right before the signal.
    """
    with _pinned(pid) as pidfd:
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
        if started is not None and process_start_ticks(pid) != started:
            raise TerminateRefused(
                f"pid {pid} is not the process whose agent memtop verified (it started at "
                "another time: the pid was reused); nothing sent"
            )
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            raise TerminateRefused(f"pid {pid} exited before the signal") from None
        except PermissionError:
            raise TerminateRefused(f"not permitted to signal pid {pid}") from None
    return f"sent {sig.name} to pid {pid} ({now.name})"


@contextlib.contextmanager
def _pinned(pid: int) -> Iterator[int | None]:
    """A pidfd for `pid` while the block runs (None where the kernel or Python has none)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise TerminateRefused(f"pid {pid} is gone (or not visible from here)") from None
    except (AttributeError, OSError):
        fd = None
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)
