"""What /proc says about a process that its pid alone cannot: when it started.  Read by the
viewer's agent checks (protocol.places) and by the kill key (sources.processes), which must
agree on it."""

from __future__ import annotations

import os


def process_start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (/proc/PID/stat field 22): unlike the pid,
    never the same for two processes that had it in turn.  None: not visible here."""
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
    # Fields after the command name (which may hold ')' and spaces): state is field 3, so
    # field 22 is the 20th after the last ')'.
    tail = proc_stat[proc_stat.rfind(b")") + 1 :].split()
    try:
        return int(tail[19])
    except (IndexError, ValueError):
        return None
