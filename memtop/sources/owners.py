"""Who the pids the driver charges are, as far as this machine can tell (issue 31, item 5): the
facts the per-GPU accounting (memtop.engine.observation) sorts each charged byte by.

For each pid the driver lists, one `PidFacts`:

- `here`: a process of memtop's own pid namespace, readable (owner known);
- `other_namespace`: it runs in another pid namespace (a container: `/proc/PID/ns/pid` differs
  from memtop's; the container id from `/proc/PID/cgroup` when it names one), or memtop itself
  runs in a container and the driver's pid, the host's, is not one it can see;
- `hidden`: /proc does not show it to this user (mounted with `hidepid`): another user's;
- `gone`: no such process, and nothing hides one: the driver still charges a pid that exited
  (its memory stays while a process it forked, a dataloader worker say, keeps the device files
  open).  For those, `holders` lists the live processes that hold a GPU device file open and
  that the driver does not list (what to stop), those of the gone pid's process group or
  session first; only processes whose /proc/PID/fd this user may read are seen.

Whether a process without an agent could take one (`memtop attach`) is said with its reason.
Reads are bounded and fail closed; the holders' scan walks /proc/*/fd, so it runs only while a
gone pid is charged, at most every HOLDERS_EVERY_S.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Mapping

from memtop.model import GONE, HERE, HIDDEN, OTHER_NAMESPACE, Holder, PidFacts
from memtop.protocol import namespaces
from memtop.sources.processes import ProcessInfo

# A device file of a GPU, as /proc/PID/fd links name it.  MEMTOP_DEVICE_FILES (paths separated
# by ':') adds prefixes: the tests' stand-in device files, a driver with other names.
DEVICE_FILE_PREFIXES = ("/dev/nvidia", "/dev/kfd", "/dev/dri/renderD")
HOLDERS_EVERY_S = 10.0
MAX_FDS = 4096  # a process's descriptors looked at, at most
MAX_HOLDERS = 16
_CGROUP_READ = 16 << 10
_CONTAINER_ID = re.compile(r"([0-9a-f]{64})")
_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")


def device_file_prefixes(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    extra = (environ if environ is not None else os.environ).get("MEMTOP_DEVICE_FILES", "")
    return DEVICE_FILE_PREFIXES + tuple(p for p in extra.split(":") if p.startswith("/"))


def _read(path: str, limit: int) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.read(fd, limit).decode("utf-8", errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def container_of(pid: int) -> str | None:
    """ "container <12 hex>" or "pod <uid>" from /proc/PID/cgroup, where it names one."""
    text = _read(f"/proc/{pid}/cgroup", _CGROUP_READ)
    if not text:
        return None
    found = _CONTAINER_ID.findall(text)
    if found:
        return f"container {found[-1][:12]}"
    pod = _POD.search(text)
    return f"pod {pod.group(1).replace('_', '-')}" if pod else None


def _hidepid() -> bool:
    """Whether /proc hides other users' processes from this one (mounted with hidepid)."""
    if os.geteuid() == 0:
        return False
    text = _read("/proc/self/mountinfo", 1 << 20) or ""
    for line in text.splitlines():
        mount, _, rest = line.partition(" - ")
        if mount.split()[4:5] != ["/proc"]:
            continue
        options = (rest.split()[2:3] or [""])[0].split(",")
        return any(
            o.startswith("hidepid=") and o not in ("hidepid=0", "hidepid=off") for o in options
        )
    return False


def _session_and_group(pid: int) -> tuple[int, int] | None:
    text = _read(f"/proc/{pid}/stat", 4096)
    if not text or ")" not in text:
        return None
    fields = text.rsplit(")", 1)[1].split()
    try:
        return int(fields[3]), int(fields[2])  # session, process group
    except (IndexError, ValueError):
        return None


def _device_files(pid: int, prefixes: tuple[str, ...]) -> tuple[str, ...]:
    directory = f"/proc/{pid}/fd"
    try:
        names = os.listdir(directory)
    except OSError:
        return ()
    found = []
    for name in names[:MAX_FDS]:
        try:
            target = os.readlink(f"{directory}/{name}")
        except OSError:
            continue
        if target.startswith(prefixes) and target not in found:
            found.append(target)
    return tuple(found)


def _looks_python(info: ProcessInfo | None) -> bool:
    if info is None:
        return False
    names = [info.name, *(os.path.basename(a) for a in info.cmdline[:1])]
    return any(_PYTHON.match(n) for n in names if n)


class GpuOwners:
    """Reads the facts above once per round for the pids the driver lists (the sampler's)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._prefixes = device_file_prefixes(environ)
        self._holders_at = -HOLDERS_EVERY_S
        self._holders: list[tuple[int, tuple[str, ...], tuple[int, int] | None, str]] = []
        self._own_namespace = namespaces.own_pid_namespace()

    def survey(
        self, pids: Iterable[int], infos: Mapping[int, ProcessInfo], listed: Iterable[int]
    ) -> dict[int, PidFacts]:
        """`pids`: those to describe; `listed`: every pid the driver charges (not holders)."""
        me = os.geteuid()
        hidden = None
        facts: dict[int, PidFacts] = {}
        gone: list[int] = []
        for pid in pids:
            # Its pid namespace read first: read, /proc has the pid (one stat, not two a pid).
            theirs = namespaces.pid_namespace(pid)
            if theirs is None and not os.path.exists(f"/proc/{pid}"):
                if hidden is None:
                    hidden = _hidepid()
                if hidden:
                    facts[pid] = PidFacts(
                        pid, HIDDEN, why="/proc hides it (hidepid): another user's process"
                    )
                elif self._own_namespace not in (None, namespaces.INIT_PID_NAMESPACE):
                    facts[pid] = PidFacts(
                        pid,
                        OTHER_NAMESPACE,
                        why="memtop runs in a pid namespace of its own (a container): the "
                        "driver's pid is the host's; run memtop on the host to see it",
                    )
                else:
                    gone.append(pid)
                continue
            ours = self._own_namespace
            if theirs is not None and ours is not None and theirs != ours:
                inside = namespaces.innermost_pid(pid)
                container = container_of(pid)
                where = f"pid {inside} there" if inside is not None else "its pid unknown"
                facts[pid] = PidFacts(
                    pid,
                    OTHER_NAMESPACE,
                    container=container,
                    why=f"another pid namespace ({container or 'a container'}, {where}): "
                    "attach inside it, or run it under memtop run with a shared socket folder",
                )
                continue
            info = infos.get(pid)
            facts[pid] = self._here(pid, info, me)
        if gone:
            holders = self._scan_holders(set(listed))
            for pid in gone:
                facts[pid] = self._gone(pid, holders)
        return facts

    @staticmethod
    def _here(pid: int, info: ProcessInfo | None, me: int) -> PidFacts:
        if info is None or not info.visible:
            return PidFacts(pid, HERE, why="its owner cannot be read")
        if me != 0 and info.uid != me:
            return PidFacts(
                pid,
                HERE,
                why=f"belongs to {info.user or info.uid}: memtop attach as that user (or root)",
            )
        if not _looks_python(info):
            return PidFacts(pid, HERE, why=f"{info.name} is not a Python process: no agent")
        return PidFacts(pid, HERE, attachable=True, why=f"memtop attach {pid}")

    def _scan_holders(
        self, listed: set[int]
    ) -> list[tuple[int, tuple[str, ...], tuple[int, int] | None, str]]:
        now = time.monotonic()
        if now - self._holders_at < HOLDERS_EVERY_S:
            return self._holders
        self._holders_at = now
        found = []
        own = os.getpid()
        try:
            entries = os.listdir("/proc")
        except OSError:
            entries = []
        for entry in entries:
            if not entry.isdigit():
                continue
            pid = int(entry)
            if pid == own or pid in listed:
                continue
            files = _device_files(pid, self._prefixes)
            if not files:
                continue
            command = (_read(f"/proc/{pid}/cmdline", 4096) or "").replace("\0", " ").strip()
            found.append((pid, files, _session_and_group(pid), command[:200]))
            if len(found) >= 4 * MAX_HOLDERS:
                break
        self._holders = found
        return found

    @staticmethod
    def _gone(
        pid: int, holders: list[tuple[int, tuple[str, ...], tuple[int, int] | None, str]]
    ) -> PidFacts:
        described = [
            Holder(h, command or "?", files, ids is not None and pid in ids)
            for h, files, ids, command in holders
        ]
        described.sort(key=lambda h: (not h.kin, h.pid))
        described = described[:MAX_HOLDERS]
        if described:
            kin = [h for h in described if h.kin]
            who = ", ".join(str(h.pid) for h in (kin or described))
            why = (
                f"exited; its memory is held by {who} (its process group), which still holds "
                "the GPU device files: stop it to free the memory"
                if kin
                else f"exited; processes still holding the GPU device files: {who}"
            )
        elif os.geteuid() == 0:
            why = "exited; no live process holds a GPU device file (the driver frees it soon)"
        else:
            why = "exited; no process this user may read holds the GPU device files"
        return PidFacts(pid, GONE, why=why, holders=tuple(described))
