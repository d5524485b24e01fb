"""The agent: a daemon thread inside the trainer that serves viewers over a local socket.

This module is its transport (the listener, one selector loop, connections and their budgets,
the CPU governor, replies posted from other threads); what each command answers is in
memtop.agent.handlers, one handler per command in its dispatch table.

Someone else's house (DESIGN §6).  What this thread may do, and what it may not:
- it never touches a tensor, an optimizer, a module or the CUDA runtime.  Breakdowns, cleanups,
  snapshots and `mem_get_info` are queued as jobs for the trainer's own thread, which runs them
  at the next step boundary (`memtop.agent.boundary`); this thread serves what was measured
  there, plus the allocator's host-side counters;
- it never raises into the trainer and never blocks it: the trainer only runs `on_step`;
- its costs are bounded: one selector loop serves every viewer; one long-lived worker thread
  writes files; connections are capped, idle ones and stalled partial frames time out, every
  connection has a request-rate budget and small buffers, and every bad request gets an error
  frame;
- only peers of the same uid (or root) are served, checked with SO_PEERCRED on accept.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memtop.agent import identity, limits_for_tests
from memtop.agent.action_log import ActionLog
from memtop.agent.boundary import MARK_BUFFER, StepBoundary, TrainerJob
from memtop.agent.floor import FloorReader, FloorState
from memtop.agent.handlers import (
    CLEANUP_MIN_INTERVAL_S,
    HANDLERS,
    SNAPSHOT_MIN_INTERVAL_S,
    STEP_STALE_S,
    Commands,
)
from memtop.agent.oom import OomRecorder
from memtop.agent.probe import Probe
from memtop.agent.sites import SiteTracker, stacks_wanted
from memtop.agent.snapshot_summary import summarize_snapshot
from memtop.protocol import commands as command_table
from memtop.protocol import framing, places, replies
from memtop.protocol.framing import (
    E_BAD_FRAME,
    E_FAILED,
    E_RATE_LIMITED,
    E_UNAVAILABLE,
    ProtocolError,
    Request,
)
from memtop.protocol.text import decimal

# The commands' intervals live with the handlers; named here too for what read them as
# server.SNAPSHOT_MIN_INTERVAL_S before the split (tests, benches).
__all__ = [
    "CLEANUP_MIN_INTERVAL_S",
    "MARK_BUFFER",
    "SNAPSHOT_MIN_INTERVAL_S",
    "STEP_STALE_S",
    "Agent",
    "summarize_snapshot",
]

# ------------------------------------------------------------------ limits (DESIGN §6, §9)
MAX_CONNECTIONS = 32
MAX_REQUEST_BYTES = 64 << 10  # requests are small; a viewer never needs more
MAX_OUTBOUND = 2 << 20  # a viewer that stops reading is dropped past this many queued bytes
IDLE_TIMEOUT_S = 120.0  # no request for this long: hang up (a paused viewer reconnects)
PARTIAL_FRAME_TIMEOUT_S = 10.0  # a frame begun and not finished within this: hang up
REQUEST_BURST = 40  # per-connection token bucket: burst ...
REQUESTS_PER_S = 20.0  # ... and sustained rate (a dashboard needs 1-10); over it, backpressure:
# the connection is not read until its budget refills, so a flood costs the trainer nothing
RECV_BYTES = 4096  # one read: at most ~100 small requests handled in a row
MAX_PENDING_PER_CONNECTION = 8  # replies a viewer may be waiting for at once
ACCEPT_BACKOFF_S = 1.0  # out of file descriptors: stop accepting for this long
SWEEP_INTERVAL_S = 0.5

# The agent thread's own CPU, measured (thread_time) every sweep: over this share of one core,
# the viewers asking more than GOVERN_EXEMPT_RATE pause until the average is back under it.
# Viewers that pipeline within their per-connection budget can still add up (32 of them); this
# bounds what the heavy ones cost.  A dashboard sampling at 2 Hz is never paused.
AGENT_MAX_CPU_SHARE = 0.005
GOVERN_EXEMPT_RATE = 12.0  # requests/s (a viewer sampling at 10 Hz): paused only if all are
GOVERN_MAX_PAUSE_S = 3.0  # a pause longer than this would trip viewers' deadlines
# Connections under GOVERN_EXEMPT_RATE are heavy still when they cost the agent more than this
# share of a core, alone or together with the other light ones of their uid: a 64 KiB request
# 11 times a second costs ~5 % of a core to parse, and 32 connections can add up.  A dashboard
# sampling one agent at 10 Hz costs ~0.35 % (measured on a loaded 2-core box).
GOVERN_EXEMPT_CPU_SHARE = 0.02
# The CPU bound holds across the connections of a uid, not only within each: a client that
# reconnects for every request starts a fresh connection budget each time, and 215 connects in
# 15 s, each with one 64 KiB deeply nested frame, held a trainer to 0.15x its step rate
# (issue 27).  Over the bound, a uid that opened more connections than a dashboard does (one per
# agent; `memtop --once`, one per run) has its new ones refused with an error frame until the
# pause ends; when refusing them still costs over the bound, the agent stops accepting for the
# pause (the kernel holds new connections in the listen backlog meanwhile, at no cost here) and
# refuses that uid's for as long again after.
CONNECT_EXEMPT_RATE = 2.0  # connections/s a uid may open and never be refused...
CONNECT_EXEMPT_BURST = 8  # ... plus this many at once
# Over the bound by this much CPU, the agent governs at once, not at the next sweep: a client
# that churns connections gets at most this much in one go.
GOVERN_EARLY_S = 0.005
WORKER_QUEUE = 4
# What the action log keeps of an action's reply (bytes released, the settings after, ...).
OUTCOME_KEYS = (
    "released_bytes",
    "reserved_after",
    "after",
    "emptied_cache",
    "devices",
    "bytes",
    "took_s",
    "nothing_to_do",
)
# The counters read right before an action (Agent.figures), by their name in the log.
ACTION_FIGURES = {
    "reserved_bytes": "reserved_bytes.all.current",
    "split_bytes": "inactive_split_bytes.all.current",
    "num_alloc_retries": "num_alloc_retries",
    "num_ooms": "num_ooms",
}
# Acting commands whose handler logs its own action: `sites` only when it switches stacks (a
# viewer asks `stacks: true` on every request while they are wanted).
LOGGED_BY_HANDLER = frozenset({"sites"})


class _Account:
    """What one uid's connections did in the governor's window, whichever connection it was:
    reconnecting resets a connection's budget, not its uid's account."""

    __slots__ = ("connects", "refuse_until", "refused")

    def __init__(self) -> None:
        self.connects = 0  # connections opened in the window (refused ones too)
        self.refused = 0  # ... of which refused for the uid's churn
        self.refuse_until = 0.0  # new connections of this uid refused until then


class Connection:
    __slots__ = (
        "action_cursor",
        "closed",
        "decoder",
        "floor",
        "interest",
        "last_request",
        "mark_cursor",
        "outbound",
        "partial_since",
        "peer_pid",
        "pending",
        "refilled",
        "resume_at",
        "sock",
        "tokens",
        "uid",
        "window_cpu",
        "window_requests",
    )

    def __init__(self, sock: socket.socket, peer_pid: int, uid: int) -> None:
        now = time.monotonic()
        self.sock = sock
        self.peer_pid = peer_pid
        self.uid = uid
        self.decoder = framing.FrameDecoder(max_frame=MAX_REQUEST_BYTES)
        self.outbound = bytearray()
        self.mark_cursor = 0  # sequence number of the last step mark this viewer has seen
        self.action_cursor = 0  # ... and of the last entry of the action log
        self.floor = FloorState()  # floor readings since its previous sample (agent/floor.py)
        self.last_request = now
        self.partial_since: float | None = None
        self.pending = 0  # deferred replies this viewer is waiting for
        self.tokens = float(REQUEST_BURST)
        self.window_requests = 0  # requests since the agent last checked its CPU
        self.window_cpu = 0.0  # the agent thread's CPU spent on it since then
        self.refilled = now
        self.resume_at: float | None = None  # reading paused (over budget) until then
        self.interest = 0  # the selector events registered now (0: not registered)
        self.closed = False

    def refill(self, now: float) -> None:
        self.tokens = min(REQUEST_BURST, self.tokens + (now - self.refilled) * REQUESTS_PER_S)
        self.refilled = now

    def pause_if_overdrawn(self, now: float) -> None:
        """Out of budget: stop reading until a request's worth has refilled."""
        if self.tokens < 1:
            self.resume_at = now + (1 - self.tokens) / REQUESTS_PER_S


class _Worker:
    """One long-lived thread for slow work that touches no tensor (pickling and writing a
    snapshot file), so the selector loop keeps serving; a bounded queue, never a thread per
    request."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=WORKER_QUEUE)
        self._thread: threading.Thread | None = None

    def submit(self, work: Callable[[], None]) -> bool:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="memtop-agent-io", daemon=True)
            self._thread.start()
        try:
            self._queue.put_nowait(work)
        except queue.Full:
            return False
        return True

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            with contextlib.suppress(Exception):
                work()

    def stop(self) -> None:
        if self._thread is not None:
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(None)


class Agent:
    def __init__(
        self,
        probe: Probe,
        directory: Path | None = None,
        pid: int | None = None,
        argv: list[str] | None = None,
    ) -> None:
        self.probe = probe
        self.boundary = StepBoundary(probe)
        self.pid = pid or os.getpid()
        self.argv = list(argv if argv is not None else sys.argv)
        # torchrun's rank variables, set before the process started: read once.
        self.rank = _env_int("RANK")
        self.local_rank = _env_int("LOCAL_RANK")
        self.world_size = _env_int("WORLD_SIZE")
        # Where it runs (Slurm job, Kubernetes pod, torchrun rendezvous): read once, bounded.
        self.scheduler = identity.scheduler()
        self.rendezvous = identity.rendezvous()
        self.directory = directory
        self.path: Path | None = None
        self.started_at = time.time()
        self._selector: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._listening = False
        self._accept_again_at = 0.0
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._replies: queue.SimpleQueue[tuple[Connection, dict[str, Any]]] = queue.SimpleQueue()
        self._connections: dict[int, Connection] = {}
        self._accounts: dict[int, _Account] = {}  # by peer uid: the owner's, root's
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.worker = _Worker()
        # Jobs queued for the trainer's thread that a viewer is waiting on, with how to answer
        # if the deadline passes first.
        self._waiting: list[tuple[TrainerJob, Connection, Request]] = []
        self._background: list[TrainerJob] = []
        self._last_sweep = 0.0
        # The governor's connect burst, unless a test lowered it (read once: limits_for_tests).
        self._connect_exempt_burst = limits_for_tests.read(os.environ).get(
            "connect_exempt_burst", CONNECT_EXEMPT_BURST
        )
        # What the commands answer, and what they keep between requests (handlers.HANDLERS).
        self.commands = Commands(self)
        # Every action performed in the trainer, whoever asked (served in `sample`).
        self.actions = ActionLog()
        self.errors = self.boundary.errors
        self.refused_requests = 0
        self.governed_s = 0.0  # time every viewer was paused to keep the agent's CPU in bounds
        self._cpu_mark = (time.monotonic(), 0.0)
        self._counted_since = time.monotonic()  # requests, CPU and connects counted since then
        # The OOM flight recorder: the allocator calls it at every out-of-memory.
        self.oom = OomRecorder(self, self.worker.submit)
        # Live memory by the user's line that allocated it (`sites`; stack recording opt-in).
        self.sites = SiteTracker(probe, wanted=stacks_wanted(os.environ))
        self.boundary.sites_hook = self.sites.on_boundary
        # The lowest allocated between samples while a viewer watches a process without steps.
        self.floor = FloorReader(probe, self.boundary)

    # ---------------------------------------------------------------- trainer side

    def on_step(self, explicit: bool = False) -> None:
        """The end of a training step (optimizer hook or memtop.step()); the trainer's thread."""
        self.boundary.on_step(explicit)

    @property
    def step(self) -> int | None:
        return self.boundary.step

    @property
    def last_step_time(self) -> float | None:
        return self.boundary.last_step_time

    @property
    def explicit_steps(self) -> bool:
        return self.boundary.explicit_steps

    @property
    def latest_breakdown(self) -> dict[str, Any] | None:
        """The newest breakdown measured at a step boundary (None before the first)."""
        return self.commands.latest_breakdown

    # ---------------------------------------------------------------- life cycle

    def start(self) -> Path:
        directory = places.ensure_socket_dir(self.directory)
        path = places.socket_path(self.pid, directory)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bound under a name no viewer looks for (a leading dot: namespaces.parse_socket_name
        # takes only `<pid>.sock` and `<pid>.ns<inode>.sock`; one character longer, as AF_UNIX's
        # 108 bytes go), listening, then renamed into place: a socket file named for the pid
        # before listen() refused every viewer that found it meanwhile ("nothing listens on
        # the agent socket"), a window a loaded box stretched to milliseconds.  The rename (same
        # directory, same inode, its 0600 mode kept) replaces a stale socket of an earlier
        # process with our pid.
        binding = path.with_name(f".{path.name}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(binding)  # left by an earlier process with our pid, killed right here
        old_umask = os.umask(0o177)
        try:
            listener.bind(str(binding))
        finally:
            os.umask(old_umask)
        listener.listen(2 * MAX_CONNECTIONS)  # viewers may knock all at once
        os.replace(binding, path)
        listener.setblocking(False)
        self._listener = listener
        self.path = path
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._listening = True
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name="memtop-agent", daemon=True)
        self._thread.start()
        attach = getattr(self.probe, "attach_oom_observer", None)
        if attach is not None:
            try:
                attach(self.oom.observe)
            except Exception as exc:  # the agent still serves; only OOM reports are lost
                self.errors.append(f"oom observer: {exc!r}")
        return path

    def stop(self, timeout: float = 2.0) -> None:
        with contextlib.suppress(Exception):
            self.probe.remove_step_hook()
        self._stopping.set()
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        # A trainer dying of its OOM: the report being written must land first.
        self.oom.flush(max(1.0, timeout))
        self.oom.enabled = False
        self.worker.stop()
        self._remove_socket()

    @property
    def thread_native_id(self) -> int | None:
        return self._thread.native_id if self._thread is not None else None

    def on_agent_thread(self) -> bool:
        """Whether the caller runs on the agent thread (not the trainer's, not the worker)."""
        return threading.current_thread() is self._thread

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    def _remove_socket(self) -> None:
        # Only the process that created the socket removes it (not a forked child).
        if self.path is not None and os.getpid() == self.pid:
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def _wake(self) -> None:
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0")

    # ---------------------------------------------------------------- server loop

    def _run(self) -> None:
        assert self._selector is not None
        self._cpu_mark = (time.monotonic(), time.thread_time())
        self._counted_since = self._cpu_mark[0]
        # The first sweep comes a full interval after the start, as every later one does: one
        # at once would hold the thread's start-up work to a share of no time at all, and
        # govern the first viewers' connections as churn.
        self._last_sweep = self._cpu_mark[0]
        try:
            while not self._stopping.is_set():
                for key, events in self._selector.select(timeout=self._select_timeout()):
                    started = time.thread_time()
                    try:
                        self._dispatch(key, events)
                    except Exception as exc:
                        self.errors.append(f"agent loop: {exc!r}")
                    if isinstance(key.data, Connection):
                        key.data.window_cpu += time.thread_time() - started
                self._flush_replies()
                now = time.monotonic()
                self._resume_reading(now)
                try:
                    if now - self._last_sweep >= SWEEP_INTERVAL_S:
                        self._last_sweep = now
                        self._govern(now)
                        self._sweep(now)
                    elif self._over_bound_by(now) > GOVERN_EARLY_S:
                        self._govern(now, early=True)
                except Exception as exc:
                    self.errors.append(f"agent sweep: {exc!r}")
                try:
                    self.floor.read_if_due(self._floor_states(), now)
                except Exception as exc:
                    # A device that cannot be read: no floor readings until the next sample.
                    self.floor.indices = ()
                    self.errors.append(f"floor reading: {exc!r}")
        finally:
            for conn in list(self._connections.values()):
                self._close(conn)
            for sock in (self._listener, self._wake_r, self._wake_w):
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.close()
            self._selector.close()

    def _over_bound_by(self, now: float) -> float:
        """The agent thread's CPU since the governor last looked, past what its share allows."""
        since, cpu_then = self._cpu_mark
        return (time.thread_time() - cpu_then) - (now - since) * AGENT_MAX_CPU_SHARE

    def _govern(self, now: float, early: bool = False) -> None:
        """Keep the agent thread's CPU under AGENT_MAX_CPU_SHARE of a core, whatever viewers do:
        over it, pause the heavy connections and refuse the new ones of uids that churn.
        `early`: between two sweeps; what viewers did is counted on until the next one."""
        over = self._over_bound_by(now)
        self._cpu_mark = (now, time.thread_time())
        conns = list(self._connections.values())
        accounts = list(self._accounts.values())
        # Rates over half a second at least: an early look must not find a dashboard heavy.
        window = max(now - self._counted_since, SWEEP_INTERVAL_S)
        if over > 0:
            pause = min(over / AGENT_MAX_CPU_SHARE, GOVERN_MAX_PAUSE_S)
            until = now + pause
            self.governed_s += pause
            # Only viewers that asked for more than a dashboard does are paused: a dashboard
            # (at most 12 requests/s, a fraction of GOVERN_EXEMPT_CPU_SHARE) is never slowed by
            # another viewer's abuse, nor by a slow box.
            light: dict[int, list[Connection]] = {}
            for conn in conns:
                if (
                    conn.window_requests > GOVERN_EXEMPT_RATE * window
                    or conn.window_cpu > GOVERN_EXEMPT_CPU_SHARE * window
                ):
                    self._pause(conn, until)
                else:
                    light.setdefault(conn.uid, []).append(conn)
            for group in light.values():
                if sum(c.window_cpu for c in group) > GOVERN_EXEMPT_CPU_SHARE * window:
                    for conn in group:
                        self._pause(conn, until)
            for account in accounts:
                if account.connects > CONNECT_EXEMPT_RATE * window + self._connect_exempt_burst:
                    account.refuse_until = max(account.refuse_until, until)
                    if account.refused:
                        # Refusing this uid's connections costs over the bound by itself: stop
                        # accepting for the pause, and refuse what waited in the backlog for as
                        # long again when accepting.
                        self._listen(False)
                        self._accept_again_at = max(self._accept_again_at, until)
                        account.refuse_until = until + pause
        if early:
            return
        self._counted_since = now
        for conn in conns:
            conn.window_requests = 0
            conn.window_cpu = 0.0
        for account in accounts:
            account.connects = account.refused = 0

    def _pause(self, conn: Connection, until: float) -> None:
        conn.resume_at = max(conn.resume_at or until, until)
        self._update_interest(conn)

    def _select_timeout(self) -> float:
        timeout = SWEEP_INTERVAL_S
        now = time.monotonic()
        if self._waiting:
            soonest = min(job.deadline for job, _, _ in self._waiting)
            timeout = min(timeout, max(0.0, soonest - now))
        for conn in self._connections.values():
            if conn.resume_at is not None:
                timeout = min(timeout, max(0.0, conn.resume_at - now))
        floor_due = self.floor.due_in(self._floor_states(), now)
        if floor_due is not None:
            timeout = min(timeout, floor_due)
        return timeout

    def _floor_states(self) -> list[FloorState]:
        return [conn.floor for conn in self._connections.values()]

    def _resume_reading(self, now: float) -> None:
        for conn in list(self._connections.values()):
            if conn.resume_at is not None and now >= conn.resume_at:
                conn.resume_at = None
                if conn.partial_since is not None:
                    # We paused reading, not the viewer: its frame's clock restarts now.
                    conn.partial_since = now
                self._drain(conn, b"")  # frames already read wait in the decoder: first
                self._update_interest(conn)

    def _dispatch(self, key: selectors.SelectorKey, events: int) -> None:
        if key.data == "accept":
            self._accept()
        elif key.data == "wake":
            with contextlib.suppress(OSError):
                while self._wake_r is not None and self._wake_r.recv(4096):
                    pass
        else:
            conn: Connection = key.data
            if events & selectors.EVENT_READ:
                self._read(conn)
            if events & selectors.EVENT_WRITE and not conn.closed:
                self._write(conn)

    def _sweep(self, now: float) -> None:
        """Deadlines: jobs no step came for, idle viewers, stalled frames, paused accepting."""
        if self._waiting:
            still = []
            for job, conn, request in self._waiting:
                if job.claimed:
                    continue  # the trainer ran it; its reply is on its way
                if now >= job.deadline and job.claim():
                    conn.pending = max(0, conn.pending - 1)
                    refusal = self._no_step(job)
                    self.log_action(conn, request, refused=refusal)
                    self._reply(conn, replies.error_reply(request.id, *refusal))
                else:
                    still.append((job, conn, request))
            self._waiting = still
        for conn in list(self._connections.values()):
            if (
                conn.pending == 0
                and conn.resume_at is None
                and now - conn.last_request > IDLE_TIMEOUT_S
            ):
                self._close(conn)
            elif (
                conn.partial_since is not None
                and conn.resume_at is None
                and now - conn.partial_since > PARTIAL_FRAME_TIMEOUT_S
            ):
                self._queue(
                    conn,
                    replies.error_reply(
                        None,
                        E_BAD_FRAME,
                        f"frame not completed within {PARTIAL_FRAME_TIMEOUT_S:.0f} s",
                    ),
                )
                self._write(conn)
                self._close(conn)
        if self._background:
            for job in self._background:
                if not job.claimed and now >= job.deadline and job.claim():
                    # No step came: let the next request schedule a fresh measurement.
                    self.commands.expired(job)
            self._background = [j for j in self._background if not j.claimed]
        if not self._listening and now >= self._accept_again_at:
            self._listen(True)

    def _no_step(self, job: TrainerJob) -> tuple[str, str]:
        last = self.boundary.last_step_time
        capture = self.boundary.last_capture_deferral
        if capture is not None and capture >= job.submitted:
            # Steps came, but each boundary found a CUDA graph being captured (DESIGN §6).
            return (
                E_UNAVAILABLE,
                f"{job.name} was not run: a CUDA graph was being captured at every step "
                "boundary since it was asked (nothing was changed)",
            )
        since = f"; the last step ended {time.time() - last:.0f} s ago" if last else ""
        return (
            E_UNAVAILABLE,
            f"{job.name} runs between training steps on the trainer's thread, and no step "
            f"ended in time{since}",
        )

    def _listen(self, on: bool) -> None:
        if self._selector is None or self._listener is None or on == self._listening:
            return
        if on:
            self._selector.register(self._listener, selectors.EVENT_READ, "accept")
        else:
            self._selector.unregister(self._listener)
        self._listening = on

    def _accept(self) -> None:
        assert self._listener is not None and self._selector is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: the listener stays readable, so select() would spin.
                    # Stop listening for a moment; the trainer's own files come first.
                    self._listen(False)
                    self._accept_again_at = time.monotonic() + ACCEPT_BACKOFF_S
                self.errors.append(f"accept: {exc!r}")
                return
            try:
                peer_pid, peer_uid, _ = places.peer_credentials(sock)
            except OSError:
                sock.close()
                continue
            refusal = None
            account = None
            if places.peer_allowed(peer_uid):
                account = self._accounts.setdefault(peer_uid, _Account())
                account.connects += 1
            if account is None:
                refusal = ("forbidden", f"uid {peer_uid} may not attach to this agent")
            elif len(self._connections) >= MAX_CONNECTIONS:
                refusal = (
                    E_UNAVAILABLE,
                    f"agent busy: it serves at most {MAX_CONNECTIONS} viewers at once",
                )
            elif account.refuse_until > time.monotonic():
                account.refused += 1
                wait = account.refuse_until - time.monotonic()
                refusal = (
                    E_RATE_LIMITED,
                    f"agent busy: uid {peer_uid} opens connections faster than a viewer does; "
                    f"new ones are refused for {max(1.0, wait):.0f} s",
                )
            if refusal is not None:
                self.refused_requests += 1
                # Say why, then hang up; a best-effort send of one small frame, never waiting.
                with contextlib.suppress(OSError, ProtocolError):
                    sock.setblocking(False)
                    sock.send(framing.encode_frame(replies.error_reply(None, *refusal)))
                sock.close()
                continue
            sock.setblocking(False)
            conn = Connection(sock, peer_pid, peer_uid)
            self._connections[sock.fileno()] = conn
            self._update_interest(conn)

    def _read(self, conn: Connection) -> None:
        # The rest of a large frame in one read: a 64 KiB request read 4 KiB at a time woke this
        # thread, and took the GIL from the trainer, 16 times.
        try:
            data = conn.sock.recv(max(RECV_BYTES, conn.decoder.missing_bytes))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:
            self._close(conn)
            return
        self._drain(conn, data)

    def _drain(self, conn: Connection, data: bytes) -> None:
        """Handle the complete frames read so far, one request's worth of budget each.

        Out of budget, the rest stay in the decoder and reading pauses (backpressure): a viewer
        that pipelines is paced at REQUESTS_PER_S, never refused for it and never stalled for
        long, and what it sent is bounded by one read plus one frame.
        """
        now = time.monotonic()
        conn.refill(now)
        try:
            for message in conn.decoder.feed(data):
                conn.tokens -= 1
                conn.window_requests += 1
                self._handle(conn, message)
                if conn.closed:
                    return
                if conn.tokens < 1:
                    break  # the decoder keeps the rest
        except ProtocolError as exc:
            # The byte stream can no longer be trusted: say why and hang up.
            self._hang_up(conn, exc.code, exc.message)
            return
        except RecursionError:
            self._hang_up(conn, E_BAD_FRAME, "frame nests too deeply")
            return
        conn.partial_since = (conn.partial_since or now) if conn.decoder.pending_bytes else None
        conn.pause_if_overdrawn(now)
        if conn.resume_at is not None:
            self._update_interest(conn)

    def _hang_up(self, conn: Connection, code: str, message: str) -> None:
        self._queue(conn, replies.error_reply(None, code, message))
        self._write(conn)
        self._close(conn)

    def _write(self, conn: Connection) -> None:
        if conn.outbound:
            try:
                sent = conn.sock.send(conn.outbound)
                del conn.outbound[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._close(conn)
                return
        self._update_interest(conn)

    def _update_interest(self, conn: Connection) -> None:
        """Register what the connection waits for; a syscall only when that changes."""
        if self._selector is None or conn.closed:
            return
        events = (selectors.EVENT_READ if conn.resume_at is None else 0) | (
            selectors.EVENT_WRITE if conn.outbound else 0
        )
        if events == conn.interest:
            return
        with contextlib.suppress(KeyError, ValueError, OSError):
            if conn.interest == 0:
                self._selector.register(conn.sock, events, conn)
            elif events == 0:
                self._selector.unregister(conn.sock)
            else:
                self._selector.modify(conn.sock, events, conn)
        conn.interest = events

    def _queue(self, conn: Connection, reply: dict[str, Any]) -> None:
        if conn.closed:
            return
        try:
            frame = framing.encode_frame(reply)
        except (ProtocolError, TypeError, ValueError) as exc:
            frame = framing.encode_frame(
                replies.error_reply(reply.get("id"), E_FAILED, f"unencodable: {exc}")
            )
        if len(conn.outbound) + len(frame) > MAX_OUTBOUND:
            self._close(conn)
            return
        conn.outbound += frame

    def _reply(self, conn: Connection, reply: dict[str, Any]) -> None:
        self._queue(conn, reply)
        if not conn.closed:
            self._write(conn)

    def _close(self, conn: Connection) -> None:
        if conn.closed:
            return
        conn.closed = True
        if self._selector is not None and conn.interest:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(conn.sock)
            conn.interest = 0
        for fileno, known in list(self._connections.items()):
            if known is conn:
                del self._connections[fileno]
        with contextlib.suppress(OSError):
            conn.sock.close()

    def post(self, conn: Connection, reply: dict[str, Any]) -> None:
        """Hand a deferred reply to the loop (from the trainer's thread or the worker)."""
        self._replies.put((conn, reply))
        self._wake()

    def _flush_replies(self) -> None:
        while True:
            try:
                conn, reply = self._replies.get_nowait()
            except queue.Empty:
                return
            conn.pending = max(0, conn.pending - 1)
            self._reply(conn, reply)

    # ---------------------------------------------------------------- requests

    def _handle(self, conn: Connection, message: dict[str, Any]) -> None:
        now = time.monotonic()
        conn.last_request = now
        try:
            request = framing.parse_request(message, HANDLERS)
        except ProtocolError as exc:
            request_id = message.get("id")
            if not isinstance(request_id, int | str) or isinstance(request_id, bool):
                request_id = None
            self._reply(conn, replies.error_reply(request_id, exc.code, exc.message))
            return
        try:
            result = self.commands.handle(conn, request)
        except ProtocolError as exc:
            self.log_action(conn, request, refused=(exc.code, exc.message))
            reply = replies.error_reply(request.id, exc.code, exc.message)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"[:500]
            self.log_action(conn, request, refused=(E_FAILED, why))
            reply = replies.error_reply(request.id, E_FAILED, why)
        else:
            if result is None:
                return  # deferred: the reply comes when the trainer's thread has done the work
            if request.cmd not in LOGGED_BY_HANDLER:
                seq = self.log_action(conn, request, outcome=result)
                if seq is not None:
                    result = {**result, "action_seq": seq}
            reply = replies.result_reply(request.id, result)
        self._reply(conn, reply)

    def log_action(
        self,
        conn: Connection,
        request: Request,
        *,
        refused: tuple[str, str] | None = None,
        outcome: dict[str, Any] | None = None,
        when: float | None = None,
        figures: dict[str, dict[str, int]] | None = None,
    ) -> int | None:
        """Log `request` in the action log (memtop.agent.action_log) if it acts on the trainer
        (a refusal too), with who asked: its sequence number, else None.  Any thread; never
        raises (a failure to log is an error counted, not the trainer's problem)."""
        try:
            if not command_table.acts(request.cmd, request.args):
                return None
            args = {k: v for k, v in request.args.items() if k != "wait_s"}
            if outcome is not None:
                outcome = {k: outcome[k] for k in OUTCOME_KEYS if k in outcome}
            if refused is None and figures is None:
                figures = self.figures()  # an action done here and now (reset_peak, stacks)
            return self.actions.append(
                request.cmd,
                args,
                uid=conn.uid,
                pid=conn.peer_pid,
                step=self.boundary.step,
                when=when,
                refused=refused,
                outcome=outcome,
                figures=figures,
            )
        except Exception as exc:
            self.errors.append(f"action log: {exc!r}")
            return None

    def figures(self) -> dict[str, dict[str, int]] | None:
        """The allocator's host-side counters an action's effect is judged by (reserved, split,
        retries, OOMs) per device the trainer uses, read now: right before a trainer-thread
        action runs, so a viewer that connects later still has a "before".  Any thread (the
        same reads as `sample`); None if they cannot be read."""
        try:
            boundary = self.boundary
            devices = boundary.devices if boundary.devices_known else []
            read = {}
            for device in devices[:16]:
                stats = self.probe.memory_stats(device.index)
                read[str(device.index)] = {
                    name: int(stats.get(key, 0)) for name, key in ACTION_FIGURES.items()
                }
            return read
        except Exception:
            return None

    def defer(
        self,
        conn: Connection,
        request: Request,
        name: str,
        run: Callable[[], Any],
        finish: Callable[[Any], dict[str, Any] | None],
        wait_s: float,
    ) -> TrainerJob:
        """Queue `run` for the trainer's thread; the viewer's reply is `finish(result)`.

        `finish` runs on the trainer's thread too, so it must be cheap; it may return None to
        say it handed the reply on (to the worker), which then posts exactly one reply.
        """
        if conn.pending >= MAX_PENDING_PER_CONNECTION:
            raise ProtocolError(
                E_RATE_LIMITED,
                f"{MAX_PENDING_PER_CONNECTION} requests of this viewer are already waiting",
            )
        request_id = request.id
        before: list[dict[str, dict[str, int]] | None] = [None]
        acting = command_table.acts(request.cmd, request.args)

        def measured() -> Any:
            # The counters right before the action, on the thread that performs it.
            before[0] = self.figures()
            return run()

        def done(job: TrainerJob) -> None:
            if job.error is not None:
                err = job.error
                code = err.code if isinstance(err, ProtocolError) else E_FAILED
                text = err.message if isinstance(err, ProtocolError) else repr(err)
                self.log_action(conn, request, refused=(code, text))
                self.post(conn, replies.error_reply(request_id, code, text[:500]))
                return
            try:
                result = finish(job.result)
                if result is None:
                    return  # handed on: whoever posts the reply logs the action
                seq = self.log_action(conn, request, outcome=result, figures=before[0])
                if seq is not None:
                    # The viewer that asked knows this entry when it comes back in a sample.
                    result = {**result, "action_seq": seq}
                reply = replies.result_reply(request_id, result)
            except ProtocolError as exc:
                self.log_action(conn, request, refused=(exc.code, exc.message))
                reply = replies.error_reply(request_id, exc.code, exc.message)
            except Exception as exc:
                reply = replies.error_reply(request_id, E_FAILED, repr(exc)[:500])
            self.post(conn, reply)

        job = TrainerJob(name, measured if acting else run, time.monotonic() + wait_s, done)
        conn.pending += 1
        self._waiting.append((job, conn, request))
        self.boundary.submit(job)
        return job

    def expire_later(self, job: TrainerJob) -> None:
        """A job nobody waits on (a periodic measurement): forgotten at its deadline."""
        self._background.append(job)


def _env_int(name: str) -> int | None:
    text = os.environ.get(name, "")
    return decimal(text.strip())  # "²" would raise into the trainer at start
