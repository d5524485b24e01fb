"""The agent: a daemon thread inside the trainer that serves viewers over a local socket.

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
import gc
import os
import pickle
import platform
import queue
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memtop import protocol
from memtop._version import __version__
from memtop.agent import files, identity, limits_for_tests
from memtop.agent.boundary import MARK_BUFFER, StepBoundary, TrainerJob
from memtop.agent.oom import OomRecorder
from memtop.agent.probe import SAMPLE_STAT_KEYS, Probe, ProbeDevice
from memtop.agent.sites import SiteTracker, stacks_wanted
from memtop.agent.snapshot_summary import summarize_snapshot

__all__ = ["MARK_BUFFER", "Agent", "summarize_snapshot"]

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

# ------------------------------------------------------------------ trainer-thread work
STEP_STALE_S = 60.0  # no step for this long: the trainer's thread is not coming back soon
BREAKDOWN_MIN_INTERVAL_S = 10.0  # at most one walk of the optimizers per this many seconds
BREAKDOWN_MAX_SHARE = 0.001  # ... and at most this share of wall time, however big the model
SUMMARY_MIN_INTERVAL_S = 30.0  # trace-free snapshot for the fragmentation summary
HISTORY_BACKOFF_S = 600.0  # memory history recording seen on: no periodic snapshots for this long
CLEANUP_MIN_INTERVAL_S = 5.0
SNAPSHOT_MIN_INTERVAL_S = 5.0
# gc.collect() takes ~120 ms in a process that imported torch (measured on this repo's CI
# machine): a cleanup or a snapshot file may take at most this share of the trainer's time,
# however often viewers ask; the interval after each grows with what it cost.
ON_DEMAND_MAX_SHARE = 0.002
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
DEFAULT_WAIT_S = 8.0  # how long a cleanup / snapshot waits for a step boundary by default
MAX_WAIT_S = 60.0
WORKER_QUEUE = 4


class _Unavailable(protocol.ProtocolError):
    def __init__(self, message: str) -> None:
        super().__init__(protocol.E_UNAVAILABLE, message)


class _Account:
    """What one uid's connections did in the governor's window, whichever connection it was:
    reconnecting resets a connection's budget, not its uid's account."""

    __slots__ = ("connects", "refuse_until", "refused")

    def __init__(self) -> None:
        self.connects = 0  # connections opened in the window (refused ones too)
        self.refused = 0  # ... of which refused for the uid's churn
        self.refuse_until = 0.0  # new connections of this uid refused until then


class _Connection:
    __slots__ = (
        "closed",
        "decoder",
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
        self.decoder = protocol.FrameDecoder(max_frame=MAX_REQUEST_BYTES)
        self.outbound = bytearray()
        self.mark_cursor = 0  # sequence number of the last step mark this viewer has seen
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


class _Cooldown:
    """When an on-demand action may run again: `minimum` after it last started, and late enough
    that what it cost (measured where it ran) stays under ON_DEMAND_MAX_SHARE of the time."""

    def __init__(self, what: str, minimum: float, max_share: float = ON_DEMAND_MAX_SHARE) -> None:
        self.what = what
        self.minimum = minimum
        self.max_share = max_share
        self.started_at = -1e9
        self.ready_at = 0.0

    def check(self) -> None:
        wait = self.ready_at - time.monotonic()
        if wait > 0:
            raise protocol.ProtocolError(
                protocol.E_RATE_LIMITED,
                f"{self.what} ran moments ago; it can run again in {max(1.0, wait):.0f} s",
            )

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.ready_at = self.started_at + self.minimum

    def cost(self, seconds: float) -> None:
        self.ready_at = max(self.ready_at, self.started_at + seconds / self.max_share)

    def refund(self) -> None:
        """The action found nothing to do and did nothing: it starts no cooldown."""
        self.ready_at = 0.0


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
        self._replies: queue.SimpleQueue[tuple[_Connection, dict[str, Any]]] = queue.SimpleQueue()
        self._connections: dict[int, _Connection] = {}
        self._accounts: dict[int, _Account] = {}  # by peer uid: the owner's, root's
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._worker = _Worker()
        # Jobs queued for the trainer's thread that a viewer is waiting on, with how to answer
        # if the deadline passes first.
        self._waiting: list[tuple[TrainerJob, _Connection, Any]] = []
        self._background: list[TrainerJob] = []
        self._last_sweep = 0.0
        # The defaults above, but where a test lowered them (read once: limits_for_tests).
        limits = limits_for_tests.read(os.environ)
        share = limits.get("on_demand_max_share", ON_DEMAND_MAX_SHARE)
        self._cleanup_cooldown = _Cooldown(
            "cleanup", limits.get("cleanup_min_interval_s", CLEANUP_MIN_INTERVAL_S), share
        )
        self._snapshot_cooldown = _Cooldown(
            "a snapshot", limits.get("snapshot_min_interval_s", SNAPSHOT_MIN_INTERVAL_S), share
        )
        self._connect_exempt_burst = limits.get("connect_exempt_burst", CONNECT_EXEMPT_BURST)
        # Measured on the trainer's thread, served from here.
        self._breakdown: dict[str, Any] | None = None
        self._breakdown_job: TrainerJob | None = None
        self._breakdown_interval = BREAKDOWN_MIN_INTERVAL_S
        self._summary: dict[str, Any] | None = None
        self._summary_job: TrainerJob | None = None
        self._history_seen_at: float | None = None
        self.errors = self.boundary.errors
        self.refused_requests = 0
        self.governed_s = 0.0  # time every viewer was paused to keep the agent's CPU in bounds
        self._cpu_mark = (time.monotonic(), 0.0)
        self._counted_since = time.monotonic()  # requests, CPU and connects counted since then
        # The OOM flight recorder: the allocator calls it at every out-of-memory.
        self.oom = OomRecorder(self, self._worker.submit)
        # Live memory by the user's line that allocated it (`sites`; stack recording opt-in).
        self.sites = SiteTracker(probe, wanted=stacks_wanted(os.environ))
        self.boundary.sites_hook = self.sites.on_boundary

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
        return self._breakdown

    # ---------------------------------------------------------------- life cycle

    def start(self) -> Path:
        directory = protocol.ensure_socket_dir(self.directory)
        path = protocol.socket_path(self.pid, directory)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a stale socket of an earlier process with our pid
        old_umask = os.umask(0o177)
        try:
            listener.bind(str(path))
        finally:
            os.umask(old_umask)
        listener.listen(2 * MAX_CONNECTIONS)  # viewers may knock all at once
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
        self._worker.stop()
        self._remove_socket()

    @property
    def thread_native_id(self) -> int | None:
        return self._thread.native_id if self._thread is not None else None

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
        try:
            while not self._stopping.is_set():
                for key, events in self._selector.select(timeout=self._select_timeout()):
                    started = time.thread_time()
                    try:
                        self._dispatch(key, events)
                    except Exception as exc:
                        self.errors.append(f"agent loop: {exc!r}")
                    if isinstance(key.data, _Connection):
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
            light: dict[int, list[_Connection]] = {}
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

    def _pause(self, conn: _Connection, until: float) -> None:
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
        return timeout

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
            conn: _Connection = key.data
            if events & selectors.EVENT_READ:
                self._read(conn)
            if events & selectors.EVENT_WRITE and not conn.closed:
                self._write(conn)

    def _sweep(self, now: float) -> None:
        """Deadlines: jobs no step came for, idle viewers, stalled frames, paused accepting."""
        if self._waiting:
            still = []
            for job, conn, request_id in self._waiting:
                if job.claimed:
                    continue  # the trainer ran it; its reply is on its way
                if now >= job.deadline and job.claim():
                    conn.pending = max(0, conn.pending - 1)
                    self._reply(conn, protocol.error_reply(request_id, *self._no_step(job)))
                else:
                    still.append((job, conn, request_id))
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
                    protocol.error_reply(
                        None,
                        protocol.E_BAD_FRAME,
                        f"frame not completed within {PARTIAL_FRAME_TIMEOUT_S:.0f} s",
                    ),
                )
                self._write(conn)
                self._close(conn)
        if self._background:
            for job in self._background:
                if not job.claimed and now >= job.deadline and job.claim():
                    # No step came: let the next request schedule a fresh measurement.
                    if job is self._breakdown_job:
                        self._breakdown_job = None
                    if job is self._summary_job:
                        self._summary_job = None
            self._background = [j for j in self._background if not j.claimed]
        if not self._listening and now >= self._accept_again_at:
            self._listen(True)

    def _no_step(self, job: TrainerJob) -> tuple[str, str]:
        last = self.boundary.last_step_time
        since = f"; the last step ended {time.time() - last:.0f} s ago" if last else ""
        return (
            protocol.E_UNAVAILABLE,
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
                peer_pid, peer_uid, _ = protocol.peer_credentials(sock)
            except OSError:
                sock.close()
                continue
            refusal = None
            account = None
            if protocol.peer_allowed(peer_uid):
                account = self._accounts.setdefault(peer_uid, _Account())
                account.connects += 1
            if account is None:
                refusal = ("forbidden", f"uid {peer_uid} may not attach to this agent")
            elif len(self._connections) >= MAX_CONNECTIONS:
                refusal = (
                    protocol.E_UNAVAILABLE,
                    f"agent busy: it serves at most {MAX_CONNECTIONS} viewers at once",
                )
            elif account.refuse_until > time.monotonic():
                account.refused += 1
                wait = account.refuse_until - time.monotonic()
                refusal = (
                    protocol.E_RATE_LIMITED,
                    f"agent busy: uid {peer_uid} opens connections faster than a viewer does; "
                    f"new ones are refused for {max(1.0, wait):.0f} s",
                )
            if refusal is not None:
                self.refused_requests += 1
                # Say why, then hang up; a best-effort send of one small frame, never waiting.
                with contextlib.suppress(OSError, protocol.ProtocolError):
                    sock.setblocking(False)
                    sock.send(protocol.encode_frame(protocol.error_reply(None, *refusal)))
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Connection(sock, peer_pid, peer_uid)
            self._connections[sock.fileno()] = conn
            self._update_interest(conn)

    def _read(self, conn: _Connection) -> None:
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

    def _drain(self, conn: _Connection, data: bytes) -> None:
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
        except protocol.ProtocolError as exc:
            # The byte stream can no longer be trusted: say why and hang up.
            self._hang_up(conn, exc.code, exc.message)
            return
        except RecursionError:
            self._hang_up(conn, protocol.E_BAD_FRAME, "frame nests too deeply")
            return
        conn.partial_since = (conn.partial_since or now) if conn.decoder.pending_bytes else None
        conn.pause_if_overdrawn(now)
        if conn.resume_at is not None:
            self._update_interest(conn)

    def _hang_up(self, conn: _Connection, code: str, message: str) -> None:
        self._queue(conn, protocol.error_reply(None, code, message))
        self._write(conn)
        self._close(conn)

    def _write(self, conn: _Connection) -> None:
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

    def _update_interest(self, conn: _Connection) -> None:
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

    def _queue(self, conn: _Connection, reply: dict[str, Any]) -> None:
        if conn.closed:
            return
        try:
            frame = protocol.encode_frame(reply)
        except (protocol.ProtocolError, TypeError, ValueError) as exc:
            frame = protocol.encode_frame(
                protocol.error_reply(reply.get("id"), protocol.E_FAILED, f"unencodable: {exc}")
            )
        if len(conn.outbound) + len(frame) > MAX_OUTBOUND:
            self._close(conn)
            return
        conn.outbound += frame

    def _reply(self, conn: _Connection, reply: dict[str, Any]) -> None:
        self._queue(conn, reply)
        if not conn.closed:
            self._write(conn)

    def _close(self, conn: _Connection) -> None:
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

    def _post(self, conn: _Connection, reply: dict[str, Any]) -> None:
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

    # ---------------------------------------------------------------- commands

    def _handle(self, conn: _Connection, message: dict[str, Any]) -> None:
        now = time.monotonic()
        conn.last_request = now
        try:
            request = protocol.parse_request(message)
        except protocol.ProtocolError as exc:
            request_id = message.get("id")
            if not isinstance(request_id, int | str) or isinstance(request_id, bool):
                request_id = None
            self._reply(conn, protocol.error_reply(request_id, exc.code, exc.message))
            return
        try:
            result = self._execute(conn, request)
        except protocol.ProtocolError as exc:
            reply = protocol.error_reply(request.id, exc.code, exc.message)
        except Exception as exc:
            reply = protocol.error_reply(
                request.id, protocol.E_FAILED, f"{type(exc).__name__}: {exc}"[:500]
            )
        else:
            if result is None:
                return  # deferred: the reply comes when the trainer's thread has done the work
            reply = {"id": request.id, "result": result}
        self._reply(conn, reply)

    def _execute(self, conn: _Connection, request: protocol.Request) -> dict[str, Any] | None:
        cmd = request.cmd
        if cmd == "sample":
            columns = self._mark_layout_arg(request) == "columns"
            return self._cmd_sample(conn, self._max_marks_arg(request), columns)
        if cmd == "hello":
            return self._cmd_hello()
        if cmd == "breakdown":
            return self._cmd_breakdown(conn, request)
        if cmd == "snapshot":
            return self._cmd_snapshot(conn, request)
        if cmd == "cleanup":
            return self._cmd_cleanup(conn, request)
        if cmd == "reset_peak":
            return self._cmd_reset_peak()
        if cmd == "sites":
            return self._cmd_sites(request)
        # parse_request only lets the closed set through
        raise protocol.ProtocolError(protocol.E_UNKNOWN_COMMAND, cmd)

    def _defer(
        self,
        conn: _Connection,
        request: protocol.Request,
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
            raise protocol.ProtocolError(
                protocol.E_RATE_LIMITED,
                f"{MAX_PENDING_PER_CONNECTION} requests of this viewer are already waiting",
            )
        request_id = request.id

        def done(job: TrainerJob) -> None:
            if job.error is not None:
                err = job.error
                code = err.code if isinstance(err, protocol.ProtocolError) else protocol.E_FAILED
                text = err.message if isinstance(err, protocol.ProtocolError) else repr(err)
                self._post(conn, protocol.error_reply(request_id, code, text[:500]))
                return
            try:
                result = finish(job.result)
                if result is None:
                    return
                reply = {"id": request_id, "result": result}
            except protocol.ProtocolError as exc:
                reply = protocol.error_reply(request_id, exc.code, exc.message)
            except Exception as exc:
                reply = protocol.error_reply(request_id, protocol.E_FAILED, repr(exc)[:500])
            self._post(conn, reply)

        job = TrainerJob(name, run, time.monotonic() + wait_s, done)
        conn.pending += 1
        self._waiting.append((job, conn, request_id))
        self.boundary.submit(job)
        return job

    def _require_steps(self, what: str) -> None:
        if not self.boundary.stepping(STEP_STALE_S):
            why = (
                "no training step has been seen"
                if self.boundary.step is None
                else f"no step for over {STEP_STALE_S:.0f} s"
            )
            raise _Unavailable(
                f"{what} runs between steps on the trainer's thread and {why} "
                "(steps are counted at optimizer.step() or memtop.step())"
            )

    @staticmethod
    def _wait_arg(request: protocol.Request, default: float) -> float:
        wait = request.args.get("wait_s", default)
        if isinstance(wait, bool) or not isinstance(wait, int | float) or wait < 0:
            raise protocol.ProtocolError(protocol.E_BAD_REQUEST, "'wait_s' must be seconds >= 0")
        return min(float(wait), MAX_WAIT_S)

    def _cmd_hello(self) -> dict[str, Any]:
        return {
            "protocol": protocol.PROTOCOL_VERSION,
            "pid": self.pid,
            "argv": self.argv,
            "python": platform.python_version(),
            "torch": self.probe.torch_version(),
            "allocator_conf": self.probe.allocator_conf(),
            "devices": [_hello_device(d) for d in self._devices()],
            # torch.version.hip: the trainer runs on ROCm (AMD GPUs); None on CUDA.
            "hip": self._hip_version(),
            "agent_version": __version__,
            "started": self.started_at,
            "step": self.boundary.step,
            "cwd": os.getcwd(),
            "agent_thread_id": self.thread_native_id,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "scheduler": self.scheduler,
            "rendezvous": self.rendezvous,
        }

    def _hip_version(self) -> str | None:
        hip = getattr(self.probe, "hip_version", None)  # optional in a Probe
        try:
            version = hip() if hip is not None else None
        except Exception:
            return None
        return version if isinstance(version, str) else None

    def _devices(self) -> list[ProbeDevice]:
        """The devices the trainer uses.  Once it steps, the list read on its own thread at a
        step boundary (refreshed every second of steps): the agent thread then asks the CUDA
        driver nothing.  A process that never stepped is asked from here."""
        if self.boundary.devices_known:
            return self.boundary.devices
        return self.probe.devices()

    @staticmethod
    def _max_marks_arg(request: protocol.Request) -> int | None:
        limit = request.args.get("max_marks")
        if limit is None:
            return None
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise protocol.ProtocolError(protocol.E_BAD_REQUEST, "'max_marks' must be an int >= 1")
        return limit

    @staticmethod
    def _mark_layout_arg(request: protocol.Request) -> str:
        layout = request.args.get("mark_layout", "rows")
        if layout not in ("rows", "columns"):
            raise protocol.ProtocolError(
                protocol.E_BAD_REQUEST, '\'mark_layout\' must be "rows" or "columns"'
            )
        return str(layout)

    def _cmd_sample(
        self, conn: _Connection, max_marks: int | None = None, columns: bool = False
    ) -> dict[str, Any]:
        boundary = self.boundary
        boundary.want_mem_info()
        devices = []
        for device in self._devices():
            stats = self.probe.memory_stats(device.index)
            if len(stats) > len(SAMPLE_STAT_KEYS):  # a probe that returns everything
                stats = {k: stats[k] for k in SAMPLE_STAT_KEYS if k in stats}
            measured = boundary.mem_info.get(device.index)
            if measured is not None:
                free, total, when = measured
            else:
                # Not measured on the trainer's thread yet (or the trainer does not step): what
                # this process alone leaves free, an upper bound.  NVML has the real figure.
                total = device.total_bytes
                free = max(0, total - stats.get("reserved_bytes.all.current", 0))
                when = None
            devices.append(
                {
                    "index": device.index,
                    "uuid": device.uuid,
                    "name": device.name,
                    "stats": stats,
                    "free_bytes": free,
                    "total_bytes": total,
                    "free_measured_at": when,
                }
            )
        marks = self._marks_since(conn, len(devices), max_marks)
        extra: dict[str, Any] = {}
        if columns:
            extra["step_mark_columns"] = protocol.mark_columns(marks)
            marks = []
        return {
            **extra,
            "time": time.time(),
            "step": boundary.step,
            "devices": devices,
            "step_marks": marks,
            "last_step_time": boundary.last_step_time,
            "phase": boundary.phase,
            "phase_since": boundary.phase_since,
            "oom": self.oom.status(),
            "agent": {
                **boundary.costs(),
                "connections": len(self._connections),
                "refused_requests": self.refused_requests,
                "agent_cpu_s": round(time.thread_time(), 6)
                if threading.current_thread() is self._thread
                else None,
                "governed_s": round(self.governed_s, 3),
            },
        }

    def _marks_since(
        self, conn: _Connection, device_count: int, max_marks: int | None = None
    ) -> list[dict[str, Any]]:
        """The step marks this viewer has not seen, newest kept when they would not fit a frame
        or pass the viewer's own `max_marks` (the dashboard reads the newest 1024 and asks for
        no more: a first reply of 4096 marks from each of 8 agents was its peak memory).

        list() of a deque is atomic under the GIL, so the trainer may append meanwhile; the
        cursor moves to the last mark actually taken, so none is skipped.
        """
        taken = list(self.boundary.marks)
        if not taken:
            return []
        last_seq = taken[-1][0]
        new = max(0, last_seq - conn.mark_cursor)
        # A mark costs ~60 bytes plus ~24 per device: stay well inside the 1 MiB frame.
        fit = max(1024, 500_000 // (60 + 24 * max(1, device_count)))
        if max_marks is not None:
            fit = min(fit, max_marks)
        conn.mark_cursor = last_seq
        return [mark for _, mark in taken[len(taken) - min(new, fit, len(taken)) :]]

    # -- breakdown: measured on the trainer's thread right after a step, served from here

    def _cmd_breakdown(self, conn: _Connection, request: protocol.Request) -> dict[str, Any] | None:
        wait = self._wait_arg(request, 0.0)
        latest = self._breakdown
        if not self.boundary.stepping(STEP_STALE_S):
            if latest is not None:
                return {**latest, "stale": True}
            self._require_steps("the breakdown")
        age = time.time() - latest["time"] if latest is not None else None
        if (age is None or age >= self._breakdown_interval) and self._breakdown_job is None:
            self._breakdown_job = self._schedule_breakdown()
        if latest is None:
            job = self._breakdown_job
            if wait > 0 and job is not None:
                # Answer when the first measurement lands (or the wait runs out).
                # A job queued after the measurement runs right after it, at the same boundary.
                self._defer(
                    conn,
                    request,
                    "the breakdown",
                    lambda: None,
                    lambda _: self._breakdown or _pending_breakdown(),
                    wait,
                )
                return None
            return _pending_breakdown()
        return latest

    def _schedule_breakdown(self) -> TrainerJob:
        def measure() -> dict[str, Any]:
            started = time.perf_counter()
            parts = self.probe.breakdown()
            took = time.perf_counter() - started
            return {
                "time": time.time(),
                "step": self.boundary.step,
                "measured": "after_step",
                "took_s": took,
                "devices": {str(i): b.as_dict() for i, b in parts.items()},
            }

        def done(job: TrainerJob) -> None:
            self._breakdown_job = None
            if job.error is None and job.result is not None:
                self._breakdown = job.result
                # However big the model, the walk takes at most BREAKDOWN_MAX_SHARE of the time.
                self._breakdown_interval = max(
                    BREAKDOWN_MIN_INTERVAL_S, job.result["took_s"] / BREAKDOWN_MAX_SHARE
                )
            elif job.error is not None:
                self.errors.append(f"breakdown: {job.error!r}")

        job = TrainerJob("the breakdown", measure, time.monotonic() + MAX_WAIT_S, done)
        self.boundary.submit(job)
        self._expire_later(job)
        return job

    def _expire_later(self, job: TrainerJob) -> None:
        """A job nobody waits on (a periodic measurement): forgotten at its deadline."""
        self._background.append(job)

    # -- snapshot: the data is taken on the trainer's thread; the file is written by the worker

    def _cmd_snapshot(self, conn: _Connection, request: protocol.Request) -> dict[str, Any] | None:
        path = request.args.get("path")
        if path is None:
            return self._snapshot_summary()
        if not isinstance(path, str) or not os.path.isabs(path) or "\0" in path:
            raise protocol.ProtocolError(protocol.E_BAD_REQUEST, "'path' must be an absolute path")
        overwrite = request.args.get("overwrite", False)
        if not isinstance(overwrite, bool):
            raise protocol.ProtocolError(protocol.E_BAD_REQUEST, "'overwrite' must be a boolean")
        self._snapshot_cooldown.check()
        self._require_steps("a snapshot")
        try:
            files.check_target(path, overwrite)  # refuse early, before the trainer pays
        except files.UnsafeTarget as exc:
            raise protocol.ProtocolError(protocol.E_BAD_REQUEST, str(exc)) from None
        self._snapshot_cooldown.start()
        request_id = request.id
        wait = self._wait_arg(request, DEFAULT_WAIT_S)

        def hand_to_worker(data: dict[str, Any]) -> None:
            # On the trainer's thread only the data was taken; pickling and writing happen on
            # the worker, which answers the viewer itself.
            def write() -> None:
                started = time.perf_counter()
                try:
                    size = files.write_private_file(
                        path, pickle.dumps(data, protocol=4), overwrite=overwrite
                    )
                except files.UnsafeTarget as exc:
                    reply = protocol.error_reply(request_id, protocol.E_BAD_REQUEST, str(exc))
                except OSError as exc:
                    reply = protocol.error_reply(
                        request_id, protocol.E_FAILED, f"cannot write {path}: {exc.strerror}"
                    )
                else:
                    summary = summarize_snapshot(data.get("segments", []))
                    reply = {
                        "id": request_id,
                        "result": {"path": path, "bytes": size, "devices": summary},
                    }
                self._snapshot_cooldown.cost(time.perf_counter() - started)
                self._post(conn, reply)

            if not self._worker.submit(write):
                raise protocol.ProtocolError(protocol.E_RATE_LIMITED, "snapshot writer is busy")
            return None

        self._defer(conn, request, "a snapshot", self.probe.snapshot, hand_to_worker, wait)
        return None

    def _snapshot_summary(self) -> dict[str, Any]:
        """The fragmentation summary of a trace-free snapshot taken on the trainer's thread at a
        low rate; served at once (the viewer asks now and then and must never wait)."""
        latest = self._summary
        age = time.time() - latest["time"] if latest is not None else None
        history_off = (
            self._history_seen_at is None
            or time.monotonic() - self._history_seen_at > HISTORY_BACKOFF_S
        )
        if (
            (age is None or age >= SUMMARY_MIN_INTERVAL_S)
            and self._summary_job is None
            and history_off
            and self.boundary.stepping(STEP_STALE_S)
        ):
            self._summary_job = self._schedule_summary()
        if latest is None:
            return {"path": None, "time": None, "devices": {}, "pending": True}
        return {**latest, "history_recording": not history_off}

    def _schedule_summary(self) -> TrainerJob:
        def measure() -> dict[str, Any]:
            data = self.probe.snapshot()
            traced = any(data.get("device_traces") or ()) or any(
                block.get("frames")
                for seg in data.get("segments", ())
                for block in seg.get("blocks", ())
            )
            return {
                "path": None,
                "time": time.time(),
                "step": self.boundary.step,
                "traced": traced,
                "devices": summarize_snapshot(data.get("segments", [])),
            }

        def done(job: TrainerJob) -> None:
            self._summary_job = None
            if job.error is None and job.result is not None:
                if job.result.pop("traced"):
                    # The trainer records memory history: every snapshot now carries stack
                    # traces and costs hundreds of ms.  Stop the periodic ones for a while.
                    self._history_seen_at = time.monotonic()
                self._summary = job.result
            elif job.error is not None:
                self.errors.append(f"snapshot summary: {job.error!r}")

        job = TrainerJob("a snapshot", measure, time.monotonic() + MAX_WAIT_S, done)
        self.boundary.submit(job)
        self._expire_later(job)
        return job

    # -- cleanup: gc + empty_cache, on the trainer's thread between two steps

    def _cmd_cleanup(self, conn: _Connection, request: protocol.Request) -> dict[str, Any] | None:
        self._cleanup_cooldown.check()
        self._require_steps("cleanup")
        wait = self._wait_arg(request, DEFAULT_WAIT_S)
        self._cleanup_cooldown.start()
        self._defer(conn, request, "cleanup", self._cleanup_now, lambda result: result, wait)
        return None

    def _cleanup_now(self) -> dict[str, Any]:
        """Runs on the trainer's thread, right after a step."""
        started = time.perf_counter()
        indices = [d.index for d in self._devices()]
        if not indices:
            # No CUDA device in use: there is no cache to empty, and gc.collect() (a few
            # hundred ms in a process that imported torch) would free no GPU memory. Nothing is
            # done, so nothing is charged: the next cleanup may run at once.
            self._cleanup_cooldown.refund()
            return {
                "released_bytes": {},
                "reserved_before": {},
                "reserved_after": {},
                "gc_collected": 0,
                "at_step_boundary": True,
                "after_step": self.boundary.step,
                "thread": threading.current_thread().name,
                "thread_ident": threading.get_ident(),
                "took_s": time.perf_counter() - started,
                "nothing_to_do": "no CUDA device in use",
            }
        before = {
            i: self.probe.memory_stats(i).get("reserved_bytes.all.current", 0) for i in indices
        }
        collected = gc.collect()
        for index in indices:
            self.probe.empty_cache(index)
        after = {
            i: self.probe.memory_stats(i).get("reserved_bytes.all.current", 0) for i in indices
        }
        took = time.perf_counter() - started
        self._cleanup_cooldown.cost(took)
        return {
            "released_bytes": {str(i): max(0, before[i] - after[i]) for i in indices},
            "reserved_before": {str(i): before[i] for i in indices},
            "reserved_after": {str(i): after[i] for i in indices},
            "gc_collected": collected,
            "at_step_boundary": True,
            "after_step": self.boundary.step,
            "thread": threading.current_thread().name,
            "thread_ident": threading.get_ident(),
            "took_s": took,
        }

    def _cmd_sites(self, request: protocol.Request) -> dict[str, Any]:
        """The newest grouping of live blocks by site; `{"stacks": true|false}` asks the
        trainer's thread to switch stack recording at its next step boundary."""
        wanted = request.args.get("stacks")
        if wanted is not None:
            if not isinstance(wanted, bool):
                raise protocol.ProtocolError(protocol.E_BAD_REQUEST, "'stacks' must be a boolean")
            if wanted and not self.sites.supported():
                raise protocol.ProtocolError(
                    protocol.E_UNAVAILABLE, "this trainer's allocator cannot record stacks"
                )
            self.sites.wanted = wanted
        return self.sites.result()

    def _cmd_reset_peak(self) -> dict[str, Any]:
        # A host-side counter reset: safe from this thread.
        indices = [d.index for d in self._devices()]
        for index in indices:
            self.probe.reset_peak(index)
        return {"devices": indices}


def _pending_breakdown() -> dict[str, Any]:
    return {"time": None, "step": None, "devices": {}, "pending": True}


def _env_int(name: str) -> int | None:
    text = os.environ.get(name, "")
    return protocol.decimal(text.strip())  # "²" would raise into the trainer at start


def _hello_device(device: ProbeDevice) -> dict[str, Any]:
    """One device of the hello.  `pci_bus_id` only where the probe knows it (the wire schema
    grows: a viewer before AMD support ignores it)."""
    entry: dict[str, Any] = {
        "index": device.index,
        "uuid": device.uuid,
        "name": device.name,
        "total_bytes": device.total_bytes,
    }
    if device.pci_bus_id is not None:
        entry["pci_bus_id"] = device.pci_bus_id
    return entry
