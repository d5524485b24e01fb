"""Pid namespaces: how an agent in a container names its socket, and how a viewer outside
finds the pid it sees for it (issue 25).

A trainer in a container has a pid inside (often 1 or 2) that differs from the pid the host,
NVML and `kill` know.  Two rules make that safe:

- An agent in the host's pid namespace names its socket `<pid>.sock` (as always).  One in
  another pid namespace names it `<pid>.ns<inode>.sock`: `<pid>` as it sees itself, `<inode>`
  its pid namespace's, so agents of many containers that share one socket directory (a host
  path mounted into every pod) never take each other's name.  Older viewers skip such names.
- A viewer keys every agent by the pid IT sees: the socket's SO_PEERCRED pid, which the kernel
  translates into the viewer's pid namespace, never the pid the agent reports.  It accepts the
  pairing only when that process's own namespace and innermost pid (`/proc/PID/ns/pid`,
  `/proc/PID/status` NSpid) give back the socket's name, so a socket cannot speak for a
  process other than the one serving it.

Reads are bounded (one small /proc file each) and fail closed: what cannot be read maps to
nothing.
"""

from __future__ import annotations

import os

# The inode of the initial (host) pid namespace: PROC_PID_INIT_INO, fixed since Linux 3.8.
INIT_PID_NAMESPACE = 0xEFFFFFFC
_STATUS_READ = 8192  # /proc/PID/status is ~1.5 KiB; NSpid sits in its first half


def pid_namespace(pid: int | str = "self") -> int | None:
    """The inode of the pid namespace of process `pid` (None: not readable from here)."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except (OSError, ValueError):
        return None


def own_pid_namespace() -> int | None:
    return pid_namespace("self")


def innermost_pid(pid: int) -> int | None:
    """Process `pid`'s pid as it sees itself (the last NSpid entry; `pid` itself on kernels
    without NSpid, before 4.1).  None: no such process visible here."""
    try:
        fd = os.open(f"/proc/{pid}/status", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, _STATUS_READ)
    except OSError:
        return None
    finally:
        os.close(fd)
    for line in data.split(b"\n"):
        if line.startswith(b"NSpid:"):
            fields = line[len(b"NSpid:") :].split()
            if fields and fields[-1].isdigit() and len(fields[-1]) <= 9:
                return int(fields[-1])
            return None
    return pid


def socket_name(pid: int, namespace: int | None) -> str:
    """The socket file name of the agent of `pid` (as it sees itself) in pid namespace
    `namespace` (None or the host's: the plain `<pid>.sock`)."""
    if namespace is None or namespace == INIT_PID_NAMESPACE:
        return f"{pid}.sock"
    return f"{pid}.ns{namespace}.sock"


def parse_socket_name(name: str) -> tuple[int, int | None] | None:
    """(pid, namespace or None) of an agent socket's file name; None for any other name.
    ASCII digits only (int() also reads '٣')."""
    stem, dot, rest = name.partition(".")
    if not dot or not (stem.isascii() and stem.isdigit()) or not 0 < len(stem) <= 9:
        return None
    if rest == "sock":
        return int(stem), None
    inode, dot, ext = rest.partition(".")
    digits = inode[2:]
    if (
        ext != "sock"
        or not dot
        or not inode.startswith("ns")
        or not (digits.isascii() and digits.isdigit())
        or len(digits) > 20
    ):
        return None
    namespace = int(digits)
    if namespace == INIT_PID_NAMESPACE:
        return None  # the host's agents never use this form: someone made it up
    return int(stem), namespace


def expected_socket_name(pid: int) -> str | None:
    """The socket name the agent of process `pid` (a pid as seen HERE) would use: from its pid
    namespace and its innermost pid.  None: the process is not visible from here."""
    namespace = pid_namespace(pid)
    inner = innermost_pid(pid)
    if namespace is None or inner is None:
        return None
    return socket_name(inner, namespace)


def own_socket_name(pid: int | None = None) -> str:
    """The socket name of this process's agent."""
    return socket_name(os.getpid() if pid is None else pid, own_pid_namespace())


# (namespace, pid inside) -> pid here, checked again before each use
_found: dict[tuple[int, int], int] = {}
_FIND_MAX_ENTRIES = 65536  # /proc entries looked at, at most, per search


def find_pid(namespace: int, inner: int) -> int | None:
    """The pid this process sees for the process `inner` of pid namespace `namespace` (None:
    no such process visible here).  A walk of /proc, remembered while it stays true."""
    key = (namespace, inner)
    known = _found.get(key)
    if known is not None:
        if pid_namespace(known) == namespace and innermost_pid(known) == inner:
            return known
        del _found[key]
    try:
        entries = os.scandir("/proc")
    except OSError:
        return None
    with entries:
        for count, entry in enumerate(entries):
            if count >= _FIND_MAX_ENTRIES:
                break
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            if pid_namespace(pid) == namespace and innermost_pid(pid) == inner:
                if len(_found) > 1024:
                    _found.clear()
                _found[key] = pid
                return pid
    return None


def foreign_socket_name(pid: int) -> str | None:
    """The socket name of the agent of `pid` (a pid as seen here) when `pid` runs in another
    pid namespace than this process; None when it shares ours (its socket is `<pid>.sock`
    there) or cannot be seen."""
    theirs = pid_namespace(pid)
    if theirs is None or theirs == own_pid_namespace():
        return None
    return expected_socket_name(pid)
