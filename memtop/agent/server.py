"""The agent: a daemon thread inside the trainer that serves viewers over a local socket.

Design constraints (DESIGN §6):
- it never raises into the trainer and never blocks it: the trainer only ever runs `on_step`,
  which appends to a bounded deque; everything else happens on the agent's own threads;
- one selector loop serves every viewer, so several can attach at once and a slow or dead one
  cannot stall the others; slow commands (snapshot, cleanup) run on short-lived worker threads
  and post their reply back through a queue;
- only peers of the same uid (or root) are served, checked with SO_PEERCRED on accept.
"""

from __future__ import annotations

import collections
import contextlib
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
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

from memtop import protocol
from memtop._version import __version__
from memtop.agent.probe import Probe

MARK_BUFFER = 4096  # step marks kept for viewers; the wire contract promises at least 1024
MAX_OUTBOUND = 8 << 20  # a viewer that stops reading is dropped past this many queued bytes
CLEANUP_MIN_INTERVAL_S = 2.0
BREAKDOWN_MIN_INTERVAL_S = 5.0
STEP_RECENT_S = 5.0  # steps seen within this window: cleanup waits for the next boundary
CLEANUP_STEP_WAIT_MAX_S = 3.0


class _Connection:
    __slots__ = ("decoder", "mark_cursor", "outbound", "peer_pid", "sock")

    def __init__(self, sock: socket.socket, peer_pid: int) -> None:
        self.sock = sock
        self.peer_pid = peer_pid
        self.decoder = protocol.FrameDecoder()
        self.outbound = bytearray()
        self.mark_cursor = 0  # sequence number of the last step mark this viewer has seen


class Agent:
    # Commands that may take seconds: run on a worker so the loop keeps serving other viewers.
    _SLOW_COMMANDS: ClassVar[Mapping[str, str]] = MappingProxyType(
        {"snapshot": "_cmd_snapshot", "cleanup": "_cmd_cleanup"}
    )

    def __init__(
        self,
        probe: Probe,
        directory: Path | None = None,
        pid: int | None = None,
        argv: list[str] | None = None,
    ) -> None:
        self.probe = probe
        self.pid = pid or os.getpid()
        self.argv = list(argv if argv is not None else sys.argv)
        self.directory = directory
        self.path: Path | None = None
        self.started_at = time.time()
        self.step: int | None = None
        self.explicit_steps = False
        self.last_step_time: float | None = None
        self._marks: collections.deque[tuple[int, dict[str, Any]]] = collections.deque(
            maxlen=MARK_BUFFER
        )
        self._mark_seq = 0
        self._mark_indices: list[int] = []
        self._mark_indices_at = 0.0
        self._selector: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._replies: queue.SimpleQueue[tuple[_Connection, dict[str, Any]]] = queue.SimpleQueue()
        self._connections: dict[int, _Connection] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._last_cleanup = 0.0
        self._breakdown_cache: tuple[float, dict[str, Any]] | None = None
        self.errors: collections.deque[str] = collections.deque(maxlen=50)

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
        listener.listen(16)
        listener.setblocking(False)
        self._listener = listener
        self.path = path
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name="memtop-agent", daemon=True)
        self._thread.start()
        return path

    def stop(self, timeout: float = 2.0) -> None:
        with contextlib.suppress(Exception):
            self.probe.remove_step_hook()
        self._stopping.set()
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._remove_socket()

    def _remove_socket(self) -> None:
        # Only the process that created the socket removes it (not a forked child).
        if self.path is not None and os.getpid() == self.pid:
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def _wake(self) -> None:
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0")

    # ---------------------------------------------------------------- trainer side

    def on_step(self, explicit: bool = False) -> None:
        """Record a training step.  Runs on the trainer's thread: cheap, and never raises."""
        try:
            if explicit:
                self.explicit_steps = True
            elif self.explicit_steps:
                return  # memtop.step() is counting; the optimizer hook would count twice
            now = time.time()
            self.step = (self.step or 0) + 1
            self.last_step_time = now
            if now - self._mark_indices_at > 1.0:
                self._mark_indices = [d.index for d in self.probe.devices()]
                self._mark_indices_at = now
            allocated = {str(i): self.probe.memory_allocated(i) for i in self._mark_indices}
            self._mark_seq += 1
            self._marks.append(
                (self._mark_seq, {"step": self.step, "time": now, "allocated_bytes": allocated})
            )
        except Exception as exc:  # the trainer must never see our failures
            self.errors.append(f"step hook: {exc!r}")

    # ---------------------------------------------------------------- server loop

    def _run(self) -> None:
        assert self._selector is not None
        try:
            while not self._stopping.is_set():
                for key, events in self._selector.select(timeout=0.5):
                    try:
                        self._dispatch(key, events)
                    except Exception as exc:
                        self.errors.append(f"agent loop: {exc!r}")
                self._flush_worker_replies()
        finally:
            for conn in list(self._connections.values()):
                self._close(conn)
            for sock in (self._listener, self._wake_r, self._wake_w):
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.close()
            self._selector.close()

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
            if events & selectors.EVENT_WRITE and conn.sock.fileno() >= 0:
                self._write(conn)

    def _accept(self) -> None:
        assert self._listener is not None and self._selector is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.errors.append(f"accept: {exc!r}")
                return
            try:
                peer_pid, peer_uid, _ = protocol.peer_credentials(sock)
            except OSError:
                sock.close()
                continue
            if not protocol.peer_allowed(peer_uid):
                # Say why, then hang up; a blocking best-effort send of one small frame.
                with contextlib.suppress(OSError):
                    sock.settimeout(0.2)
                    protocol.send_message(
                        sock,
                        protocol.error_reply(
                            None, "forbidden", f"uid {peer_uid} may not attach to this agent"
                        ),
                    )
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Connection(sock, peer_pid)
            self._connections[sock.fileno()] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:
            self._close(conn)
            return
        try:
            for message in conn.decoder.feed(data):
                self._handle(conn, message)
        except protocol.ProtocolError as exc:
            # The byte stream can no longer be trusted: say why and hang up.
            self._queue(conn, protocol.error_reply(None, exc.code, exc.message))
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
        if self._selector is None or conn.sock.fileno() < 0:
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbound else 0)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.modify(conn.sock, events, conn)

    def _queue(self, conn: _Connection, reply: dict[str, Any]) -> None:
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

    def _close(self, conn: _Connection) -> None:
        fileno = conn.sock.fileno()
        if fileno >= 0 and self._selector is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
        self._connections.pop(fileno, None)
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _flush_worker_replies(self) -> None:
        while True:
            try:
                conn, reply = self._replies.get_nowait()
            except queue.Empty:
                return
            if conn.sock.fileno() >= 0:
                self._queue(conn, reply)
                self._write(conn)

    # ---------------------------------------------------------------- commands

    def _handle(self, conn: _Connection, message: dict[str, Any]) -> None:
        try:
            request = protocol.parse_request(message)
        except protocol.ProtocolError as exc:
            request_id = message.get("id")
            if not isinstance(request_id, int | str) or isinstance(request_id, bool):
                request_id = None
            self._queue(conn, protocol.error_reply(request_id, exc.code, exc.message))
            self._write(conn)
            return
        if request.cmd in self._SLOW_COMMANDS:
            handler = getattr(self, self._SLOW_COMMANDS[request.cmd])
            self._run_in_worker(conn, request, handler)
            return
        self._queue(conn, self._execute(request, conn))
        self._write(conn)

    def _execute(
        self,
        request: protocol.Request,
        conn: _Connection,
        handler: Callable[[protocol.Request], dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        try:
            if handler is not None:
                result = handler(request)
            elif request.cmd == "hello":
                result = self._cmd_hello()
            elif request.cmd == "sample":
                result = self._cmd_sample(conn)
            elif request.cmd == "breakdown":
                result = self._cmd_breakdown()
            elif request.cmd == "reset_peak":
                result = self._cmd_reset_peak()
            else:  # parse_request only lets the closed set through
                raise protocol.ProtocolError(protocol.E_UNKNOWN_COMMAND, request.cmd)
        except protocol.ProtocolError as exc:
            return protocol.error_reply(request.id, exc.code, exc.message)
        except Exception as exc:
            return protocol.error_reply(
                request.id, protocol.E_FAILED, f"{type(exc).__name__}: {exc}"[:500]
            )
        return {"id": request.id, "result": result}

    def _run_in_worker(
        self,
        conn: _Connection,
        request: protocol.Request,
        handler: Callable[[protocol.Request], dict[str, Any]],
    ) -> None:
        def work() -> None:
            self._replies.put((conn, self._execute(request, conn, handler)))
            self._wake()

        threading.Thread(target=work, name=f"memtop-agent-{request.cmd}", daemon=True).start()

    def _cmd_hello(self) -> dict[str, Any]:
        return {
            "protocol": protocol.PROTOCOL_VERSION,
            "pid": self.pid,
            "argv": self.argv,
            "python": platform.python_version(),
            "torch": self.probe.torch_version(),
            "allocator_conf": self.probe.allocator_conf(),
            "devices": [
                {"index": d.index, "uuid": d.uuid, "name": d.name, "total_bytes": d.total_bytes}
                for d in self.probe.devices()
            ],
            "agent_version": __version__,
            "started": self.started_at,
            "step": self.step,
            "cwd": os.getcwd(),
        }

    def _cmd_sample(self, conn: _Connection) -> dict[str, Any]:
        devices = []
        for device in self.probe.devices():
            free, total = self.probe.mem_get_info(device.index)
            devices.append(
                {
                    "index": device.index,
                    "uuid": device.uuid,
                    "name": device.name,
                    "stats": self.probe.memory_stats(device.index),
                    "free_bytes": free,
                    "total_bytes": total,
                }
            )
        marks = self._marks_since(conn, len(devices))
        return {
            "time": time.time(),
            "step": self.step,
            "devices": devices,
            "step_marks": marks,
            "last_step_time": self.last_step_time,
        }

    def _marks_since(self, conn: _Connection, device_count: int) -> list[dict[str, Any]]:
        """The step marks this viewer has not seen, newest kept when they would not fit a frame.

        list() of a deque is atomic under the GIL, so the trainer may append meanwhile; the
        cursor moves to the last mark actually taken, so none is skipped.
        """
        taken = list(self._marks)
        if not taken:
            return []
        last_seq = taken[-1][0]
        new = max(0, last_seq - conn.mark_cursor)
        # A mark costs ~60 bytes plus ~24 per device: stay well inside the 1 MiB frame.
        fit = max(1024, 500_000 // (60 + 24 * max(1, device_count)))
        conn.mark_cursor = last_seq
        return [mark for _, mark in taken[len(taken) - min(new, fit, len(taken)) :]]

    def _cmd_breakdown(self) -> dict[str, Any]:
        now = time.monotonic()
        cached = self._breakdown_cache
        if cached is not None and now - cached[0] < BREAKDOWN_MIN_INTERVAL_S:
            return cached[1]
        result = {
            "time": time.time(),
            "devices": {str(i): b.as_dict() for i, b in self.probe.breakdown().items()},
        }
        self._breakdown_cache = (now, result)
        return result

    def _cmd_reset_peak(self) -> dict[str, Any]:
        indices = [d.index for d in self.probe.devices()]
        for index in indices:
            self.probe.reset_peak(index)
        return {"devices": indices}

    def _cmd_snapshot(self, request: protocol.Request) -> dict[str, Any]:
        path = request.args.get("path")
        if path is not None and (not isinstance(path, str) or not os.path.isabs(path)):
            raise protocol.ProtocolError(protocol.E_BAD_REQUEST, "'path' must be an absolute path")
        data = self.probe.snapshot()
        if path is not None:
            tmp = f"{path}.tmp-{os.getpid()}"
            with open(tmp, "wb") as fh:
                pickle.dump(data, fh)
            os.replace(tmp, path)
        return {"path": path, "devices": summarize_snapshot(data.get("segments", []))}

    def _cmd_cleanup(self, request: protocol.Request) -> dict[str, Any]:
        now = time.monotonic()
        if now - self._last_cleanup < CLEANUP_MIN_INTERVAL_S:
            raise protocol.ProtocolError(
                protocol.E_RATE_LIMITED,
                f"cleanup ran less than {CLEANUP_MIN_INTERVAL_S:.0f} s ago; try again shortly",
            )
        self._last_cleanup = now
        at_boundary = self._wait_for_step_boundary()
        indices = [d.index for d in self.probe.devices()]
        before = {
            i: self.probe.memory_stats(i).get("reserved_bytes.all.current", 0) for i in indices
        }
        collected = gc.collect()
        for index in indices:
            self.probe.empty_cache(index)
        after = {
            i: self.probe.memory_stats(i).get("reserved_bytes.all.current", 0) for i in indices
        }
        return {
            "released_bytes": {str(i): max(0, before[i] - after[i]) for i in indices},
            "reserved_before": {str(i): before[i] for i in indices},
            "reserved_after": {str(i): after[i] for i in indices},
            "gc_collected": collected,
            "at_step_boundary": at_boundary,
        }

    def _wait_for_step_boundary(self) -> bool:
        """Wait (bounded) for the next step when the trainer is stepping; True if one came."""
        last = self.last_step_time
        if last is None or time.time() - last > STEP_RECENT_S:
            return False
        start_seq = self._mark_seq
        deadline = time.monotonic() + CLEANUP_STEP_WAIT_MAX_S
        while time.monotonic() < deadline:
            if self._mark_seq != start_seq:
                return True
            time.sleep(0.002)
        return False


def summarize_snapshot(segments: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per device: reserved, allocated, inactive (large pool), largest inactive block, and the
    external fragmentation 1 − largest inactive / total inactive (DESIGN §4)."""
    out: dict[str, dict[str, Any]] = {}
    for seg in segments:
        dev = out.setdefault(
            str(seg.get("device", 0)),
            {
                "segments": 0,
                "reserved_bytes": 0,
                "allocated_bytes": 0,
                "inactive_large_bytes": 0,
                "largest_inactive_large_bytes": 0,
            },
        )
        dev["segments"] += 1
        dev["reserved_bytes"] += int(seg.get("total_size", 0))
        large = seg.get("segment_type") == "large"
        for block in seg.get("blocks", []):
            size = int(block.get("size", 0))
            if block.get("state") == "active_allocated":
                dev["allocated_bytes"] += size
            elif block.get("state") == "inactive" and large:
                dev["inactive_large_bytes"] += size
                dev["largest_inactive_large_bytes"] = max(dev["largest_inactive_large_bytes"], size)
    for dev in out.values():
        inactive = dev["inactive_large_bytes"]
        largest = dev["largest_inactive_large_bytes"]
        dev["external_fragmentation"] = (1.0 - largest / inactive) if inactive else 0.0
    return out
