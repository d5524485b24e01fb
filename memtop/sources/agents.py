"""What the memtop process reads from agents: discovery of sockets and one client per agent.

Three modules: the pool here (discovery, one authenticated connection per agent, rounds of
concurrent samples), the client of one agent (memtop.sources.agent_client) and the sanity checks
of an agent's numbers (memtop.sources.agent_sanity); this module re-exports their public names.

The viewer trusts no agent (DESIGN §6, issue 10):

- every connection is authenticated before a byte is sent: the directory and the socket are
  checked with lstat (no symlink followed), and the server's SO_PEERCRED must show the pid in the
  socket's name running as the directory's owner; `hello` must name the same pid;
- every request has one overall deadline that no stream of frames can extend, and agents are
  polled concurrently, so a stopped, slow or flooding agent costs the others nothing and a round
  ends on time: a round's samples to open connections are sent and read on the poll thread, on
  one poll(2) set (a thread per agent cost eight threads fighting over the GIL every second);
  connecting, hellos, low-rate commands and a reply still unfinished when the round ends run on
  a few worker threads (a bound that does not grow with agents);
- replies are decoded with depth and size limits (protocol.decode_body), checked against the
  schema, and every string in them is made inert (protocol.clean_text) before anything shows it;
- the numbers must make sense (allocated <= reserved <= total, counters that never go backwards,
  a GPU the driver knows); an agent breaking that is `inconsistent` and its numbers are not used.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import resource
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from memtop import protocol
from memtop.model import (  # AgentView: the record a poll makes, named here for its importers
    MARK_WINDOW,
    AgentBreakdown,
    AgentHello,
    AgentSample,
    AgentSites,
    AgentSnapshot,
    AgentStatus,
    AgentView,
)
from memtop.protocol import namespaces
from memtop.sources.agent_client import (
    HELLO_REFRESH_S,
    MAX_STRAY_FRAMES,
    AgentClient,
    AgentError,
    AgentRefused,
    AgentTimeout,
    AgentUnreachable,
    PendingReply,
    parse_sample,
)
from memtop.sources.agent_sanity import (
    MONOTONIC_STATS,
    SIGNED_STATS,
    sanity_problem,
    this_machine_bytes,
)

__all__ = [
    "CONNECTED",
    "EXITED",
    "HELLO_REFRESH_S",
    "HUNG",
    "INCONSISTENT",
    "MAX_STRAY_FRAMES",
    "MONOTONIC_STATS",
    "REFUSED",
    "SAMPLE_MAX_MARKS",
    "SIGNED_STATS",
    "UNREACHABLE",
    "AgentClient",
    "AgentError",
    "AgentPool",
    "AgentRefused",
    "AgentTimeout",
    "AgentUnreachable",
    "AgentView",
    "PendingReply",
    "parse_sample",
    "sanity_problem",
]

# A first sample asks for the marks the viewer reads, not the agent's whole buffer.
SAMPLE_MAX_MARKS = MARK_WINDOW


def _into_inbox(inbox: list[tuple[str, Any]], client: AgentClient, sample: AgentSample) -> None:
    """A sample into its agent's inbox; when the agent changed since its hello (a new device),
    the hello is asked again and goes in first: the sample's devices are checked against it."""
    if client.hello_is_stale(sample):
        inbox.append(("hello", client.refresh_hello()))
    inbox.append(("sample", sample))


def _settled(outcome: BaseException | None) -> Future[Any]:
    """A job that is already over: done, or failed with `outcome`."""
    future: Future[Any] = Future()
    if outcome is None:
        future.set_result(None)
    else:
        future.set_exception(outcome)
    return future


# The job of a sample read and delivered on the poll thread: one future done for good, shared
# (a Future made per agent per round was a lock and a condition each, to be read once).
_DONE = _settled(None)


# States of an agent as the viewer sees it (kept as names here for existing importers).
CONNECTED = AgentStatus.CONNECTED
EXITED = AgentStatus.EXITED
UNREACHABLE = AgentStatus.UNREACHABLE
HUNG = AgentStatus.HUNG
INCONSISTENT = AgentStatus.INCONSISTENT
REFUSED = AgentStatus.REFUSED


class _Workers:
    """Daemon threads running jobs: a job blocked on a hung agent never delays exit.

    A thread is started whenever none is idle, up to `size`; beyond that, jobs wait their turn.
    The bound is a constant, not one per agent (a user's 256 agents once cost the exporter 260
    threads): what runs here is rare (connecting, hellos, low-rate commands, a reply not
    finished when its round ended), each job ends by its request's deadline, and an agent that
    misses it backs off, so the queue drains even with many stopped agents."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a job and not yet promised one

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        with self._lock:
            if self._idle > 0:
                self._idle -= 1  # promised to this job
            elif len(self._threads) < self._size:
                thread = threading.Thread(target=self._run, name="memtop-agents", daemon=True)
                thread.start()
                self._threads.append(thread)
        future: Future[Any] = Future()
        self._jobs.put((future, job))
        return future

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            future, job = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except BaseException as exc:  # handed to the poll thread, never lost
                    future.set_exception(exc)
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        with self._lock:
            for _ in self._threads:
                self._jobs.put(None)
            self._threads = []
            self._idle = 0


@dataclass
class _Agent:
    """What the pool keeps about one agent socket between rounds."""

    pid: int
    directory: Path
    owner: int
    name: str | None = None  # the socket's name for a process of another pid namespace
    client: AgentClient | None = None
    hello: AgentHello | None = None
    state: AgentStatus | None = None
    error: str | None = None
    job: Future[Any] | None = None
    # What the job in flight has received so far: ("hello"|"sample"|cmd, value); the job appends,
    # the poll thread takes (list.append and slicing are atomic).
    inbox: list[tuple[str, Any]] = field(default_factory=list)
    retry_at: float = 0.0
    backoff: float = 0.0
    hung_since: float | None = None  # wall time
    counters: dict[str, int] = field(default_factory=dict)
    inconsistent_until: float = 0.0
    last_violation: str | None = None
    started: int | None = None  # when the process behind its last connection started


class _Scan(NamedTuple):
    found: dict[int, tuple[Path, int]]  # pid -> (directory, owner)
    refused: dict[int, tuple[str, int]]  # pid -> (why, owner)
    problems: tuple[str, ...]
    # pid (as this viewer sees it) -> socket name, for agents in other pid namespaces
    names: Mapping[int, str] = {}


def _descriptor_limit() -> int:
    """The most file descriptors this process may hold (RLIMIT_NOFILE's soft limit)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def _directory_version(directory: Path, owner: int) -> tuple[object, ...] | None:
    """What changes whenever an entry of `directory` is made, removed or replaced (None: it
    cannot be read, so scan)."""
    try:
        info = os.lstat(directory)
    except OSError:
        return None
    return (directory, owner, info.st_ino, info.st_mtime_ns, info.st_ctime_ns)


class AgentPool:
    """Finds agent sockets, keeps one authenticated connection to each, samples them all
    concurrently.

    `timeout` is each request's overall deadline.  `poll()` returns within its budget whatever
    any agent does: an agent still busy when the round ends keeps its job and is harvested in a
    later round; one that misses its deadline is marked hung (once, with since when) and retried
    with back-off; one that fails authentication is refused and retried rarely.
    """

    RETRY_S = 5.0  # an unreachable agent is retried this often
    HUNG_BACKOFF_MAX_S = 30.0
    REFUSED_RETRY_S = 30.0
    INCONSISTENT_HOLD_S = 30.0  # an agent caught lying stays marked this long
    MAX_AGENTS_PER_USER = 64
    MAX_REFUSED_ROWS = 16
    # Threads for requests in flight, started as needed (samples to open connections need none:
    # they are read on the poll thread).
    WORKERS = 16
    LOW_RATE_RETRY_S = 1.0  # a low-rate command the agent could not answer yet
    PENDING_RETRY_S = 0.1  # one the agent answered "pending" (measured at the next step)
    UNSUPPORTED_RETRY_S = 600.0  # one the agent does not know (another implementation)
    SITES_OFF_RETRY_S = 30.0  # `sites` of an agent that records no stacks
    # Every socket is checked again (owner, kind, liveness, zombies) at least this often; in
    # between, a round whose directories have the very same entries only asks whether each
    # agent's process still exists (see _scan).
    FULL_SCAN_S = 5.0
    # File descriptors kept for everything but agent connections (see connection_room).
    DESCRIPTORS_KEPT = 40

    def __init__(self, directory: Path | None = None, timeout: float = 1.0) -> None:
        self.directory = directory
        self.timeout = timeout
        # Every reply of every agent, as (pid, cmd, result): see AgentClient.tap.
        self.tap: Callable[[int, str, dict[str, Any]], None] | None = None
        # Why a socket directory (or entries in it) was not read, one line each, for the UI.
        self.problems: list[str] = []
        # Low-rate commands sent to a connected agent after its sample: cmd -> seconds.
        self.low_rate: dict[str, float] = {}
        self._agents: dict[int, _Agent] = {}
        self._due: dict[tuple[int, str], float] = {}
        self._workers = _Workers(self.WORKERS)
        # Pids whose server passed authentication since the viewer started (the kill key), each
        # with when its process started (protocol.process_start_ticks; None: not readable).
        self._verified: dict[int, int | None] = {}
        self._refused_gone: set[int] = set()
        # Sockets of agents in other pid namespaces: name -> (socket inode, pid seen here).
        self._foreign: dict[str, tuple[int, int]] = {}
        # ... and those refused: name -> (socket inode, retry after, why).
        self._foreign_refused: dict[str, tuple[int, float, str]] = {}
        # The last full scan: (its directories' versions, when, what it found).
        self._last_scan: tuple[tuple[object, ...], float, _Scan] | None = None
        # Every user's socket directory, as root finds them from round to round.
        self._finder = protocol.SocketDirs()

    # ------------------------------------------------------------------ discovery

    def connection_room(self) -> int:
        """How many agents may be connected at once: what the descriptor limit leaves once
        the viewer's own files (the driver, /proc reads, the exporter's clients) are kept
        aside.  Running out mid-round would fail at random places, psutil's /proc reads
        included; the agents beyond this are named in one line instead."""
        return max(0, _descriptor_limit() - self.DESCRIPTORS_KEPT)

    def _scan(self) -> _Scan:
        """Sockets worth talking to, by pid; and those refused on sight, with why.

        Checking every socket (its owner and kind, its process alive and no zombie, that
        process's owner) was ~5 system calls per agent every second.  A directory whose entries
        did not change keeps its mtime (any socket made, removed or replaced changes it; only
        its owner could turn the clock back, and the directory is checked to be theirs and
        private), so a round that finds every directory as it was reuses the last scan and
        only asks whether each agent's process still exists; any doubt, and every FULL_SCAN_S,
        scans in full."""
        if self.directory:
            directories, unread = [(self.directory, os.getuid())], []
        else:
            discovery = protocol.discover(self._finder)
            directories, unread = discovery.dirs, discovery.problems
        versions = tuple(_directory_version(directory, owner) for directory, owner in directories)
        now = time.monotonic()
        last = self._last_scan
        if (
            last is not None
            and None not in versions
            and last[0] == versions
            and 0 <= now - last[1] < self.FULL_SCAN_S
            and all(protocol.pid_exists(pid) for pid in last[2].found)
        ):
            self.problems = unread + list(last[2].problems)
            return last[2]
        scan = self._full_scan(directories)
        self.problems = unread + self.problems
        self._last_scan = (versions, now, scan)
        return scan

    def _full_scan(self, directories: list[tuple[Path, int]]) -> _Scan:
        found: dict[int, tuple[Path, int]] = {}
        refused: dict[int, tuple[str, int]] = {}
        problems: list[str] = []
        foreign: dict[int, str] = {}
        own_namespace = namespaces.own_pid_namespace()
        # Agents read per owner, whichever of the owner's directories they are in.
        read_of: dict[int, int] = {}
        listed_foreign: set[str] = set()
        for directory, owner in directories:
            try:
                protocol.check_socket_dir(directory, owner)
                names = os.listdir(directory)
            except FileNotFoundError:
                continue
            except protocol.UnsafeSocketDir as exc:
                problems.append(f"ignoring agents: {exc}")
                continue
            except OSError as exc:
                problems.append(f"ignoring agents: cannot list {directory}: {exc.strerror}")
                continue
            candidates = []
            foreign_seen = 0
            for name in names:
                parsed = namespaces.parse_socket_name(name)
                if parsed is None:
                    continue
                path = directory / name
                pid, namespace = parsed
                if namespace is not None and namespace != own_namespace:
                    # An agent in a container: found by the pid this viewer sees (at most as
                    # many per directory as agents are read from one).
                    foreign_seen += 1
                    listed_foreign.add(name)
                    if foreign_seen > self.MAX_AGENTS_PER_USER:
                        continue
                    seen = self._resolve_foreign(path, owner, problems)
                    if seen is not None:
                        foreign[seen] = name
                        candidates.append(seen)
                    continue
                if not protocol.pid_alive(pid):
                    with contextlib.suppress(OSError):
                        os.unlink(path)  # stale (unlink never follows a symlink)
                    continue
                try:
                    protocol.check_socket_entry(path, owner)
                except protocol.PeerRefused as exc:
                    refused.setdefault(pid, (f"refused: {exc}", owner))
                    continue
                except OSError:
                    continue
                process_owner = protocol.pid_owner(pid)
                if process_owner is not None and process_owner != owner:
                    refused.setdefault(
                        pid,
                        (
                            f"refused: {path} is in uid {owner}'s directory but pid {pid} "
                            f"belongs to uid {process_owner}",
                            owner,
                        ),
                    )
                    continue
                candidates.append(pid)
            if foreign_seen > self.MAX_AGENTS_PER_USER:
                problems.append(
                    f"uid {owner}: {foreign_seen} agent sockets of other pid namespaces in "
                    f"{directory}; reading the first {self.MAX_AGENTS_PER_USER}"
                )
            candidates = sorted(pid for pid in set(candidates) if pid not in found)
            room = max(0, self.MAX_AGENTS_PER_USER - read_of.get(owner, 0))
            if len(candidates) > room:
                problems.append(
                    f"uid {owner}: {len(candidates)} agent sockets in {directory}; reading "
                    f"{room} (at most {self.MAX_AGENTS_PER_USER} agents per user)"
                )
                candidates = candidates[:room]
            read_of[owner] = read_of.get(owner, 0) + len(candidates)
            for pid in candidates:
                found[pid] = (directory, owner)
        # A refused socket that claims the pid of an agent found where it belongs never stands
        # for it: it is only mentioned.
        for pid in sorted(set(refused) & set(found))[: self.MAX_REFUSED_ROWS]:
            problems.append(f"pid {pid}: {refused[pid][0]}")
        refused = {pid: why for pid, why in refused.items() if pid not in found}
        if len(refused) > self.MAX_REFUSED_ROWS:
            problems.append(
                f"{len(refused)} agent sockets refused (wrong owner, symlinks, not sockets); "
                f"showing {self.MAX_REFUSED_ROWS}"
            )
            refused = dict(sorted(refused.items())[: self.MAX_REFUSED_ROWS])
        room = self.connection_room()
        if len(found) > room:
            problems.append(
                f"reading {room} of {len(found)} agents: each is a connection, and memtop may "
                f"hold {_descriptor_limit()} open file descriptors (ulimit -n); raise the limit "
                "to read them all"
            )
            found = dict(sorted(found.items())[:room])
        # Only the sockets still there: a container's trainer that exited took its socket
        # with it, and its entry would stay for as long as the viewer runs.
        self._foreign = {k: v for k, v in self._foreign.items() if k in listed_foreign}
        self.problems = problems
        in_sight = {pid: name for pid, name in foreign.items() if pid in found}
        return _Scan(found, refused, tuple(problems), in_sight)

    def _resolve_foreign(self, path: Path, owner: int, problems: list[str]) -> int | None:
        """The pid this viewer sees for the agent socket `path` of another pid namespace, or
        None (stale: removed; refused or out of sight: one line in `problems`).

        The kernel tells: SO_PEERCRED's pid is translated into our namespace.  Nothing is sent;
        the process must be the one the name stands for (namespace inode and innermost pid)
        and run as the directory's owner.  Known sockets (same inode) are checked again with
        two small /proc reads instead of a connection; refused ones are not tried again before
        REFUSED_RETRY_S unless replaced.  The connection is non-blocking: a listener whose
        backlog is full (a stopped or hostile agent) costs the round nothing."""
        name = path.name
        try:
            protocol.check_socket_entry(path, owner)
            inode = os.lstat(path).st_ino
        except protocol.PeerRefused as exc:
            problems.append(f"refused: {exc}")
            return None
        except OSError:
            return None
        known = self._foreign.get(name)
        if known is not None and known[0] == inode:
            seen = known[1]
            if protocol.pid_alive(seen) and namespaces.expected_socket_name(seen) == name:
                return seen
        self._foreign.pop(name, None)
        now = time.monotonic()
        refused = self._foreign_refused.get(name)
        if refused is not None and refused[0] == inode and now < refused[1]:
            problems.append(refused[2])
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(str(path))
            seen, uid, _ = protocol.peer_credentials(sock)
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(OSError):
                os.unlink(path)  # stale: nobody listens (unlink never follows a symlink)
            return None
        except BlockingIOError:
            return None  # its backlog is full: asked again at the next full scan
        except OSError as exc:
            problems.append(f"cannot reach the agent socket {path}: {exc.strerror or exc}")
            return None
        finally:
            sock.close()
        why = None
        if seen <= 0:
            why = (
                f"ignoring {path}: its process is not visible from this pid namespace (run the "
                "viewer in the host's pid namespace, e.g. a pod with hostPID: true)"
            )
        elif uid != owner:
            why = f"refused: {path} is served by uid {uid}, not by its owner {owner}"
        elif namespaces.expected_socket_name(seen) != name:
            why = f"refused: {path} is served by pid {seen}, not the process it names"
        if why is not None:
            if len(self._foreign_refused) > 4 * self.MAX_AGENTS_PER_USER:
                self._foreign_refused.clear()
            self._foreign_refused[name] = (inode, now + self.REFUSED_RETRY_S, why)
            problems.append(why)
            return None
        self._foreign[name] = (inode, seen)
        return seen

    # ------------------------------------------------------------------ polling

    def poll(
        self, known_devices: Mapping[str, int] | None = None, budget: float | None = None
    ) -> list[AgentView]:
        """One round.  `known_devices`: GPU UUID (and PCI bus id) -> total bytes as the driver
        reports them (None: no driver view).  `budget`: the most this call waits for answers
        (default: the request timeout)."""
        started = time.monotonic()
        budget = self.timeout if budget is None else budget
        found, refused, _, names = self._scan()
        results: dict[int, AgentView] = {}
        for pid in list(self._agents):
            if pid not in found:
                results[pid] = self._gone(self._agents.pop(pid))
        waiting: list[Future[Any]] = []
        sampling: list[tuple[_Agent, PendingReply]] = []
        for pid, (directory, owner) in found.items():
            agent = self._agents.get(pid)
            name = names.get(pid)
            if agent is None or (agent.directory, agent.owner, agent.name) != (
                directory,
                owner,
                name,
            ):
                if agent is not None:
                    self._drop_client(agent)
                agent = self._agents[pid] = _Agent(pid, directory, owner, name)
            if agent.job is None and started >= agent.retry_at:
                extras = self._extras_due(agent)
                client = agent.client
                if client is not None and client.connected and not extras:
                    # The common round: a plain sample on an open connection, sent here and
                    # read below with every other agent's in one poll(2) set (no thread each).
                    try:
                        pending = client.send_sample(
                            None, SAMPLE_MAX_MARKS, columns=True, wait_to_send=False
                        )
                        sampling.append((agent, pending))
                    except Exception as exc:  # AgentUnreachable, AgentTimeout: its failure
                        agent.job = _settled(exc)
                else:
                    agent.job = self._workers.submit(self._job_for(agent, extras))
            if agent.job is not None and agent.state != HUNG:
                waiting.append(agent.job)
        if sampling:
            waiting += self._read_samples(sampling, started + budget)
        if waiting:
            remaining = budget - (time.monotonic() - started)
            wait(waiting, timeout=max(0.0, remaining))
        for pid in found:
            poll = self._harvest(self._agents[pid], known_devices)
            if poll is not None:
                results[pid] = poll
        for pid, (why, owner) in refused.items():
            results[pid] = AgentView(pid, REFUSED, error=why, owner=owner)
        self._refused_gone = set(refused)
        return [results[pid] for pid in sorted(results)]

    def ask_soon(self, pid: int, cmd: str) -> None:
        """Send low-rate `cmd` to `pid` in the next round (the user just changed what it
        answers: stack recording switched on)."""
        self._due[(pid, cmd)] = 0.0

    def _extras_due(self, agent: _Agent) -> list[str]:
        """The low-rate commands due for `agent` now (marked as sent)."""
        now = time.monotonic()
        extras = [
            cmd
            for cmd, interval in self.low_rate.items()
            if interval > 0 and now >= self._due.get((agent.pid, cmd), 0.0)
        ]
        for cmd in extras:
            self._due[(agent.pid, cmd)] = now + self.low_rate[cmd]
        return extras

    def _read_samples(
        self, sampling: list[tuple[_Agent, PendingReply]], round_ends: float
    ) -> list[Future[Any]]:
        """Read the replies of the samples sent this round as their bytes arrive, all on this
        thread, until every one is in or the round ends.  Each agent's job is then settled: its
        sample delivered, its failure recorded, or (a reply not complete when the round ends, a
        hello to ask again) handed to a worker that finishes it within the request's own
        deadline, as a job started on a worker would have.  The workers' futures.

        The sockets are waited on with poll(2) (`select.poll`: registering a socket is a
        dictionary entry, not a system call): a `selectors` selector each round was an epoll
        made and closed and two epoll_ctl calls per agent, with the module's keys and lookups
        around each: with a Future per agent, ~1/8 of the thread's work a round for eleven agents
        (measured in-process, the mixed demo: the poll 3.4 -> 2.9 ms a round, load ~25)."""
        handed: list[Future[Any]] = []
        waiting: dict[int, tuple[_Agent, PendingReply]] = {}  # by socket descriptor
        poller = select.poll()
        for agent, pending in sampling:
            # A reply read along with an earlier one never wakes poll (the pool sends one
            # request at a time, but an agent may run ahead): look first.
            if not self._settle(agent, pending, pending.read_buffered, handed):
                fd = pending.fileno()
                poller.register(fd, select.POLLIN)
                waiting[fd] = (agent, pending)
        while waiting:
            now = time.monotonic()
            if now >= round_ends:
                break
            soonest = min(pending.deadline for _, pending in waiting.values())
            timeout_ms = math.ceil(max(0.0, min(round_ends, soonest) - now) * 1000)
            ready = {fd for fd, _ in poller.poll(timeout_ms)}
            now = time.monotonic()
            for fd, (agent, pending) in list(waiting.items()):
                # Ready, or past its deadline (it fails on reading).
                if (fd in ready or now >= pending.deadline) and self._settle(
                    agent, pending, pending.read_available, handed
                ):
                    poller.unregister(fd)
                    del waiting[fd]
        for agent, pending in waiting.values():
            agent.job = self._workers.submit(self._finish_sample(agent, pending))
            handed.append(agent.job)
        return handed

    def _settle(
        self,
        agent: _Agent,
        pending: PendingReply,
        read: Callable[[], dict[str, Any] | None],
        handed: list[Future[Any]],
    ) -> bool:
        """Read a sample's reply; once it is in or has failed, settle the agent's job (True),
        into `handed` when a worker still has it to finish."""
        try:
            result = read()
            if result is None:
                return False
            job = self._deliver(agent, pending.client, parse_sample(result))
        except Exception as exc:  # the request's failure is the agent's
            job = _settled(exc)
        agent.job = job
        if not job.done():
            handed.append(job)
        return True

    def _finish_sample(self, agent: _Agent, pending: PendingReply) -> Callable[[], None]:
        def job() -> None:
            _into_inbox(agent.inbox, pending.client, pending.wait_then(parse_sample))

        return job

    def _deliver(self, agent: _Agent, client: AgentClient, sample: AgentSample) -> Future[Any]:
        """A sample read on the poll thread, into the agent's inbox: at once, or on a worker
        when its hello must be asked for again first (a request: never on the poll thread)."""
        if not client.hello_is_stale(sample):
            agent.inbox.append(("sample", sample))
            return _DONE
        return self._workers.submit(lambda: _into_inbox(agent.inbox, client, sample))

    def _job_for(self, agent: _Agent, extras: list[str]) -> Callable[[], None]:
        client = agent.client
        if client is None:
            client = agent.client = AgentClient(
                agent.pid, agent.directory, self.timeout, agent.owner, agent.name
            )
            client.tap = self.tap
        inbox = agent.inbox

        def job() -> None:
            if not client.connected:
                hello = client.connect()
                inbox.append(("started", client.started))
                inbox.append(("hello", hello))
            _into_inbox(inbox, client, client.sample(max_marks=SAMPLE_MAX_MARKS, columns=True))
            for cmd in extras:
                # An agent without the command (another implementation of the protocol) is
                # still a fine agent: the dashboard just goes without that figure.
                try:
                    raw = client.sites() if cmd == "sites" else client.request(cmd)
                    reply = protocol.parse_reply(cmd, raw)
                except AgentError as exc:
                    if exc.code == protocol.E_UNKNOWN_COMMAND:
                        inbox.append(("unsupported", cmd))  # an older agent: ask rarely
                    else:
                        inbox.append(("retry", cmd))  # not ready yet (no step seen): soon
                    continue
                if reply.pending:
                    # Measured at the trainer's next step boundary: ask again shortly.
                    inbox.append(("pending", cmd))
                else:
                    inbox.append((cmd, reply))

        return job

    def _harvest(self, agent: _Agent, known_devices: Mapping[str, int] | None) -> AgentView | None:
        """Apply what the agent's job delivered; the row for this round (None: nothing known
        yet about an agent still answering its first request)."""
        received = agent.inbox[:]
        del agent.inbox[: len(received)]
        sample: AgentSample | None = None
        breakdown: AgentBreakdown | None = None
        snapshot: AgentSnapshot | None = None
        sites: AgentSites | None = None
        for kind, value in received:
            if kind == "started":
                agent.started = value
            elif kind == "hello":
                agent.hello = value
                self._verified[agent.pid] = agent.started
            elif kind == "sample":
                sample = value
            elif kind == "retry":
                self._due[(agent.pid, value)] = time.monotonic() + self.LOW_RATE_RETRY_S
            elif kind == "pending":
                self._due[(agent.pid, value)] = time.monotonic() + self.PENDING_RETRY_S
            elif kind == "unsupported":
                self._due[(agent.pid, value)] = time.monotonic() + self.UNSUPPORTED_RETRY_S
            elif isinstance(value, AgentBreakdown):
                breakdown = value
            elif isinstance(value, AgentSnapshot):
                snapshot = value
            elif isinstance(value, AgentSites):
                sites = value
                # No stacks recorded: nothing to read for a while, unless they were asked for
                # (MEMTOP_STACKS=1 or the `k` key) and start at the trainer's next boundary:
                # then at the usual pace (a trainer started with stacks showed no site for
                # the first 30 s).
                if not value.enabled and not value.wanted:
                    self._due[(agent.pid, "sites")] = time.monotonic() + self.SITES_OFF_RETRY_S
        job = agent.job
        if job is not None and job.done():
            agent.job = None
            exc = job.exception()
            if exc is not None:
                self._failed(agent, exc)
                sample, breakdown, snapshot, sites = None, None, None, None
        if sample is not None:
            now = time.monotonic()
            problem = sanity_problem(
                agent.hello, sample, known_devices, agent.counters, this_machine_bytes()
            )
            if problem is not None:
                agent.inconsistent_until = now + self.INCONSISTENT_HOLD_S
                agent.last_violation = problem
            agent.hung_since = None
            agent.backoff = 0.0
            if now < agent.inconsistent_until:
                # Its numbers are neither kept nor summed nor used for suggestions.
                agent.state = INCONSISTENT
                agent.error = f"numbers that cannot be true: {agent.last_violation}"
                sample, breakdown, snapshot, sites = None, None, None, None
            else:
                agent.state, agent.error = CONNECTED, None
        if agent.state is None:
            return None
        return AgentView(
            agent.pid,
            agent.state,
            agent.hello,
            sample=sample,
            error=agent.error,
            breakdown_reply=breakdown,
            snapshot_reply=snapshot,
            sites_reply=sites,
            owner=agent.owner,
        )

    def _failed(self, agent: _Agent, exc: BaseException) -> None:
        self._drop_client(agent)
        now = time.monotonic()
        if isinstance(exc, AgentRefused):
            agent.state, agent.error = REFUSED, str(exc)
            agent.retry_at = now + self.REFUSED_RETRY_S
        elif isinstance(exc, AgentTimeout):
            if agent.hung_since is None:
                agent.hung_since = time.time()
            agent.backoff = min(self.HUNG_BACKOFF_MAX_S, max(1.0, agent.backoff * 2))
            since = time.strftime("%H:%M:%S", time.localtime(agent.hung_since))
            agent.state = HUNG
            agent.error = f"hung since {since}: {exc}"
            agent.retry_at = now + agent.backoff
        else:
            alive = protocol.pid_alive(agent.pid)
            agent.state = UNREACHABLE if alive else EXITED
            agent.error = (str(exc) or type(exc).__name__) if alive else "process exited"
            if not isinstance(exc, AgentUnreachable | AgentError):
                agent.error = f"agent of pid {agent.pid}: {type(exc).__name__}: {exc}"[:300]
            agent.retry_at = now + self.RETRY_S

    def _gone(self, agent: _Agent) -> AgentView:
        self._drop_client(agent)
        self._due = {k: v for k, v in self._due.items() if k[0] != agent.pid}
        alive = protocol.pid_alive(agent.pid)
        if not alive:
            # Nothing left to signal; kept, it would be one entry per trainer ever seen.
            self._verified.pop(agent.pid, None)
        why = "agent stopped (its socket was removed)" if alive else "process exited"
        return AgentView(agent.pid, EXITED, agent.hello, error=why, owner=agent.owner)

    def _drop_client(self, agent: _Agent) -> None:
        client = agent.client
        agent.client = None
        if client is None:
            return
        if agent.job is not None and not agent.job.done():
            client.abort()  # the job fails at once and closes it
        else:
            client.close()

    # ------------------------------------------------------------------ for actions

    def directory_of(self, pid: int) -> Path | None:
        """Where the socket of `pid` was found (for actions on a fresh connection)."""
        agent = self._agents.get(pid)
        return agent.directory if agent is not None else self.directory

    def socket_name_of(self, pid: int) -> str | None:
        """The socket's file name of `pid` when it runs in another pid namespace (else None)."""
        agent = self._agents.get(pid)
        return agent.name if agent is not None else None

    def owner_of(self, pid: int) -> int | None:
        agent = self._agents.get(pid)
        return agent.owner if agent is not None else None

    def verified(self, pid: int) -> bool:
        """Whether an agent serving as `pid` passed authentication since the viewer started."""
        return pid in self._verified

    def verified_start(self, pid: int) -> int | None:
        """When the process that passed authentication as `pid` started (clock ticks since
        boot; None: never verified, or its start time could not be read)."""
        return self._verified.get(pid)

    def unanswered(self) -> int:
        """How many agents are still answering their first request (no row for them yet)."""
        return sum(1 for a in self._agents.values() if a.state is None and a.job is not None)

    def state_of(self, pid: int) -> AgentStatus | None:
        agent = self._agents.get(pid)
        if agent is not None:
            return agent.state
        return REFUSED if pid in self._refused_gone else None

    def client(self, pid: int) -> AgentClient | None:
        agent = self._agents.get(pid)
        return agent.client if agent is not None and agent.job is None else None

    def close(self) -> None:
        for agent in self._agents.values():
            self._drop_client(agent)
        self._workers.close()
