"""What /proc says about a process that its pid alone cannot: when it started.  Read by the
viewer's agent checks (protocol.places) and by the kill key (sources.processes), which must
agree on it."""

from __future__ import annotations

import os


def stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat's fields after the command name (which may hold ')' and spaces): [0] is
    the state (field 3), [19] the start time (field 22).  None: not visible here.  os.open and
    read, not open(): no buffered file object for one small read (a viewer asks this of every
    agent every second)."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        proc_stat = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    return proc_stat[proc_stat.rfind(b")") + 1 :].split()


def process_start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (/proc/PID/stat field 22): unlike the pid,
    never the same for two processes that had it in turn.  None: not visible here."""
    tail = stat_fields(pid)
    try:
        return int(tail[19]) if tail is not None else None
    except (IndexError, ValueError):
        return None
