"""The viewer's connection to one agent (DESIGN §6): AgentClient and the replies it waits for.

It trusts no agent: the socket and the server are authenticated before a byte is sent
(protocol.connect_agent: lstat, SO_PEERCRED) and `hello` must name the same pid; every request
has one overall deadline that no stream of frames can extend, on a socket that never blocks;
replies are decoded with depth and size limits (protocol.decode_body), and every string in them
is made inert (protocol.clean_text) before anything shows it.  The pool that keeps one client
per agent is memtop.sources.agents; the sanity checks of the numbers, memtop.sources.agent_sanity.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from memtop import protocol
from memtop.model import AgentHello, AgentSample
from memtop.protocol import namespaces
from memtop.protocol.text import inert_json


class AgentError(Exception):
    """An error frame from an agent (the command failed there; the connection is still fine)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} ({code})")
        self.code = code
        self.message = message


class AgentUnreachable(Exception):
    """The agent cannot be reached or the connection broke; the message is one line."""


class AgentRefused(AgentUnreachable):
    """The socket or the process serving it failed authentication; the message is one line."""


class AgentTimeout(AgentUnreachable):
    """The agent did not answer within its deadline (stopped, deadlocked, flooding frames)."""


# Frames with another id a reply may be preceded by before the agent counts as flooding.
MAX_STRAY_FRAMES = 32
# An agent that had no torch yet when it said hello is asked again this often.
HELLO_REFRESH_S = 5.0


RECV_CHUNK = 1 << 16
# Held while a reply waited for on a thread (PendingReply.wait_then) is decoded and made into its
# record: one reply's JSON objects in memory at a time, however many workers wait.
_DECODING = threading.Lock()
R = TypeVar("R")


def _as_it_is(result: dict[str, Any]) -> dict[str, Any]:
    return result


class PendingReply:
    """A request sent, its reply not yet read.

    Read either all at once on the calling thread (`wait`, blocking until the request's one
    deadline), or a piece at a time as bytes arrive (`read_available`, never blocking: the
    sampler's poll thread reads many agents' replies this way in one poll(2) set, and hands a
    reply still unfinished when its round ends to a worker, which `wait`s for the rest).  One
    reader at a time.  The reply's failures are the request's: AgentTimeout (no reply by the
    deadline, or a flood of frames answering nothing), AgentUnreachable (the connection broke
    or the frame is bad; the connection is closed), AgentError (the agent's error frame).
    """

    def __init__(
        self, client: AgentClient, cmd: str, request_id: int, deadline: float, limit: float
    ) -> None:
        self.client = client
        self.cmd = cmd
        self.request_id = request_id
        self.deadline = deadline
        self._limit = limit  # the request's timeout, for the message if it runs out
        self._stray = 0
        self._reply: dict[str, Any] | None = None
        self._inert = False  # its frame holds only clean strings (protocol.text.inert_json)

    def fileno(self) -> int:
        sock = self.client._sock
        return sock.fileno() if sock is not None else -1

    def read_buffered(self) -> dict[str, Any] | None:
        """The reply's result if the frames already read from this connection hold it (read
        along with an earlier reply), without touching the socket; else None."""
        if self._reply is None:
            with self.client._failures(self):
                self._take(b"")
        return self._result()

    def read_available(self) -> dict[str, Any] | None:
        """Take the bytes the socket holds now; the reply's result once it is complete.  (Call
        `read_buffered` first: frames already read are not looked at again here.)"""
        if self._reply is None:
            with self.client._failures(self):
                sock = self.client._connected_socket()
                try:
                    data: bytes | None = sock.recv(RECV_CHUNK)  # the socket never blocks
                except BlockingIOError:
                    data = None
                if data is not None:
                    self._take(data, at_end=not data)
                if self._reply is None and time.monotonic() >= self.deadline:
                    raise TimeoutError
        return self._result()

    def wait(self) -> dict[str, Any]:
        """Block until the reply is complete or the deadline passes; the result."""
        return self.wait_then(_as_it_is)

    def wait_then(self, then: Callable[[dict[str, Any]], R]) -> R:
        """`wait`, and what `then` makes of the result (AgentClient.sample: the parsed sample).

        The reply's frame is decoded and `then` runs under one lock (_DECODING) that every
        thread waiting this way shares; bytes are received outside it.  A connection's first
        sample decodes to ~200 KB of JSON objects (an agent's backlog of step marks): the
        dashboard's first round connects to every agent at once on the pool's workers, and
        eleven such replies decoded side by side held ~1.5 MB at once, what the heap's
        high-water mark (the process's RSS for good) grew by.  One at a time, each reply's
        objects are gone (made into `then`'s compact value) before the next is decoded; the
        GIL ran them one at a time anyway."""
        data: bytes | None = None  # first, the frames read with an earlier reply
        while True:
            with _DECODING:
                with self.client._failures(self):
                    self._take(data or b"", at_end=data == b"")
                reply = self._reply
                if reply is not None:
                    self._reply = None  # (read once: its objects go with `then`'s return)
                    return then(self.client._result(self.cmd, reply, self._inert))
            with self.client._failures(self):
                data = self._receive()

    def _receive(self) -> bytes:
        """The bytes the socket has (b"": the agent closed it), waiting for some up to the
        deadline."""
        while True:
            sock = self.client._connected_socket()
            try:
                return sock.recv(RECV_CHUNK)
            except BlockingIOError:
                _wait_for(sock, select.POLLIN, self.deadline)

    def _result(self) -> dict[str, Any] | None:
        if self._reply is None:
            return None
        return self.client._result(self.cmd, self._reply, self._inert)

    def _take(self, data: bytes, at_end: bool = False) -> None:
        """Look for the reply among the frames `data` completes (b"": among those already
        read); `at_end`: the agent closed the connection."""
        if at_end:
            raise protocol.ConnectionClosed("connection closed by the agent")
        for message in self.client._decoder.feed(data):
            reply_id = message.get("id")
            if reply_id == self.request_id or (reply_id is None and "error" in message):
                self._reply = message
                # (asked of the reply's frame only: strays are dropped unread)
                decoder = self.client._decoder
                self._inert = inert_json(decoder.last_body)
                # Its bytes are not held until the connection's next frame: a first sample's
                # are ~40 KB an agent, all the agents' held at once through the first round.
                decoder.last_body = b""
                return  # bytes after it stay in the decoder, for the next request to read
            self._stray += 1
            if self._stray >= MAX_STRAY_FRAMES:
                raise AgentTimeout(
                    f"floods the connection: {self._stray} frames that answer no request"
                )

    def timed_out(self) -> AgentTimeout:
        extra = f" ({self._stray} frames with other ids)" if self._stray else ""
        return AgentTimeout(f"no reply to {self.cmd!r} within {self._limit:.3g} s{extra}")


def _wait_for(sock: socket.socket, event: int, deadline: float) -> None:
    """Until `sock` is ready for `event` (select.POLLIN / POLLOUT); TimeoutError once the
    deadline (time.monotonic) has passed.  The client's sockets never block: every wait is
    here, against the request's one deadline (no timeout set on the socket per call)."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    poller = select.poll()
    poller.register(sock, event)
    if not poller.poll(max(1, math.ceil(remaining * 1000))) and time.monotonic() >= deadline:
        raise TimeoutError


class _Failures:
    """AgentClient._failures: a class, not a generator's context manager (made, entered and
    left two or three times per agent per round: a generator and its frame each time)."""

    __slots__ = ("client", "pending")

    def __init__(self, client: AgentClient, pending: PendingReply) -> None:
        self.client = client
        self.pending = pending

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, _: object
    ) -> None:
        if exc is None or not isinstance(exc, Exception):
            return  # nothing went wrong (or a KeyboardInterrupt, SystemExit: not ours)
        client = self.client
        if isinstance(exc, AgentTimeout | AgentUnreachable):
            client.close()
            return  # raised as it is
        client.close()
        if isinstance(exc, TimeoutError):
            raise self.pending.timed_out() from None
        if isinstance(exc, OSError | protocol.ConnectionClosed):
            reason = str(exc) or type(exc).__name__
            raise AgentUnreachable(f"agent of pid {client.pid}: {reason}") from None
        if isinstance(exc, protocol.ProtocolError):
            raise AgentUnreachable(f"agent of pid {client.pid} sent a bad frame: {exc}") from None
        # RecursionError, MemoryError on a hostile reply, …
        raise AgentUnreachable(
            f"agent of pid {client.pid} sent an unreadable reply ({type(exc).__name__})"
        ) from None


def parse_sample(result: dict[str, Any]) -> AgentSample:
    """A `sample` result checked against the wire schema (AgentError where it fails)."""
    try:
        return protocol.parse_sample(result)
    except protocol.ProtocolError as exc:
        raise AgentError(exc.code, exc.message) from None


class AgentClient:
    """A blocking connection to one agent.  Used from a sampler worker or an action worker.

    `owner` is the uid that must own the socket directory and run the agent (default: ours).
    `pid` is the pid THIS process sees; `name` the socket's file name when that process runs in
    another pid namespace (a container: `<its own pid>.ns<inode>.sock`), whose agent then says
    it is the pid in the name (protocol.namespaces).
    """

    def __init__(
        self,
        pid: int,
        directory: Path | None = None,
        timeout: float = 2.0,
        owner: int | None = None,
        name: str | None = None,
    ) -> None:
        self.pid = pid
        self.name = name
        parsed = namespaces.parse_socket_name(name) if name is not None else None
        # The pid the agent reports in its hello: its own, inside its namespace.
        self.agent_pid = parsed[0] if parsed is not None else pid
        self.directory = directory
        self.timeout = timeout
        self.owner = os.getuid() if owner is None else owner
        self._sock: socket.socket | None = None
        self._decoder = protocol.FrameDecoder()  # bytes of this connection not yet a frame
        self._next_id = 1
        self.hello: AgentHello | None = None
        self.hello_at = 0.0
        # When the process behind the socket started (clock ticks since boot), as read when the
        # connection passed its checks: what a signal to that pid is checked against later.
        self.started: int | None = None
        # Whether this connection had the agent's past `sites` rounds (its first request asks).
        self._sites_history_read = False
        # Called with (pid, cmd, result) for every reply (`memtop record` taps the wire here).
        self.tap: Callable[[int, str, dict[str, Any]], None] | None = None

    def connect(self, timeout: float | None = None) -> AgentHello:
        """Connect, authenticate the server and read its `hello`, all within `timeout`."""
        limit = timeout or self.timeout
        deadline = time.monotonic() + limit
        directory = self.directory or protocol.socket_dir()
        try:
            self._decoder = protocol.FrameDecoder()
            self._sites_history_read = False
            self._sock, self.started = protocol.connect_agent_process(
                self.pid, directory, self.owner, limit, name=self.name
            )
            self._sock.setblocking(False)  # every wait is against a deadline (_wait_for)
        except (protocol.PeerRefused, protocol.UnsafeSocketDir) as exc:
            raise AgentRefused(f"refused: {exc}") from None
        except FileNotFoundError as exc:
            raise AgentUnreachable(protocol.describe_connect_error(self.pid, exc)) from None
        except OSError as exc:
            raise AgentUnreachable(protocol.describe_connect_error(self.pid, exc)) from None
        try:
            reply = self._request("hello", None, deadline, limit)
        except (AgentUnreachable, AgentError) as exc:
            # An agent in a user namespace that does not map our uid sees us as the overflow
            # uid and hangs up on us (a "Broken pipe" here, or its "forbidden" frame): say so.
            why = protocol.unmapped_here(self.pid)
            if why is None or isinstance(exc, AgentRefused):
                raise
            self.close()
            raise AgentUnreachable(why) from None
        return self._accept_hello(reply)

    def _accept_hello(self, reply: dict[str, Any]) -> AgentHello:
        """Parse a `hello` and hold it to the socket's pid; on any doubt, hang up."""
        try:
            hello = protocol.parse_hello(reply)
        except protocol.ProtocolError as exc:
            self.close()
            raise AgentUnreachable(f"bad hello from the agent of pid {self.pid}: {exc}") from None
        if hello.pid != self.agent_pid:
            self.close()
            raise AgentRefused(
                f"refused: the agent behind the socket of pid {self.pid} says it is pid "
                f"{hello.pid}"
                + (f" (expected {self.agent_pid} in its pid namespace)" if self.name else "")
            )
        self.hello = hello
        self.hello_at = time.monotonic()
        return hello

    def hello_is_stale(self, sample: AgentSample) -> bool:
        """Whether the agent has changed since its hello: it uses a device the hello did not
        list (CUDA initialised after the agent started), or it had no torch yet (an agent
        started before the program imported torch: asked again every HELLO_REFRESH_S)."""
        hello = self.hello
        if hello is None:
            return False
        listed = {d.index for d in hello.devices}
        if any(d.index not in listed for d in sample.devices):
            return True
        return hello.torch is None and time.monotonic() - self.hello_at >= HELLO_REFRESH_S

    def refresh_hello(self, timeout: float | None = None) -> AgentHello:
        """Ask for `hello` again on this connection (same pid checks as on connect)."""
        return self._accept_hello(self.request("hello", None, timeout))

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def request(
        self, cmd: str, args: dict[str, Any] | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        """Send one command and wait for its reply, at most `timeout` seconds in all; returns
        `result` (every string in it cleaned) or raises AgentError / AgentUnreachable."""
        limit = timeout or self.timeout
        return self._request(cmd, args, time.monotonic() + limit, limit)

    def _request(
        self, cmd: str, args: dict[str, Any] | None, deadline: float, limit: float
    ) -> dict[str, Any]:
        return self.send(cmd, args, deadline, limit=limit).wait()

    def send(
        self,
        cmd: str,
        args: dict[str, Any] | None = None,
        deadline: float | None = None,
        wait_to_send: bool = True,
        limit: float | None = None,
    ) -> PendingReply:
        """Send one command; its reply is read through the PendingReply (by `deadline`,
        time.monotonic; default: the client's timeout from now).  A request the socket cannot
        take at once (an agent that does not read its requests) waits for it up to the
        deadline, or with `wait_to_send=False` fails at once: the poll thread, which sends to
        every agent in turn, never waits on one of them.  `limit`: the timeout the request was
        given, for the message should it run out (default: what is left until the deadline;
        measured here, a loaded box's pause since the caller set the deadline read as "no reply
        within 0.599 s" for a 0.6 s timeout)."""
        if deadline is None:
            limit = self.timeout if limit is None else limit
            deadline = time.monotonic() + limit
        elif limit is None:
            limit = max(0.0, deadline - time.monotonic())
        request_id = self._next_id
        self._next_id += 1
        message: dict[str, Any] = {"id": request_id, "cmd": cmd}
        if args:
            message["args"] = args
        pending = PendingReply(self, cmd, request_id, deadline, limit)
        with self._failures(pending):
            sock = self._connected_socket()
            unsent = memoryview(protocol.encode_frame(message))
            while unsent:  # at once, nearly always (a request fits an empty socket buffer)
                try:
                    unsent = unsent[sock.send(unsent) :]
                except BlockingIOError:  # an agent that does not read: up to the deadline
                    if not wait_to_send:
                        raise AgentTimeout(
                            f"does not read its requests ({len(unsent)} bytes of {cmd!r} unsent)"
                        ) from None
                    _wait_for(sock, select.POLLOUT, deadline)
        return pending

    def _connected_socket(self) -> socket.socket:
        if self._sock is None:
            raise AgentUnreachable(f"not connected to the agent of pid {self.pid}")
        return self._sock

    def _failures(self, pending: PendingReply) -> _Failures:
        """What goes wrong on the wire, as the one-line errors a request raises; the connection
        is closed on all but an agent's own error frame."""
        return _Failures(self, pending)

    def _result(self, cmd: str, reply: dict[str, Any], inert: bool = False) -> dict[str, Any]:
        """The result of a reply (every string in it cleaned), or its error as AgentError.
        `inert`: its frame holds only clean strings (text.inert_json), so the walk that cleans
        them would change nothing (a steady sample: ~70 strings, ~20 µs a reply)."""
        error = reply.get("error")
        if error is not None:
            if not isinstance(error, dict):
                error = {"code": "bad_reply", "message": str(error)}
            raise AgentError(
                protocol.clean_text(error.get("code", "error"), 40),
                protocol.clean_text(error.get("message", ""), 300),
            )
        result = reply.get("result")
        if not isinstance(result, dict):
            raise AgentError("bad_reply", f"reply to {cmd!r} carries no result object")
        cleaned: dict[str, Any] = result if inert else protocol.clean_value(result)
        if self.tap is not None:
            self.tap(self.pid, cmd, cleaned)
        return cleaned

    def sites(self, timeout: float | None = None) -> dict[str, Any]:
        """`sites` (its result, for protocol.parse_sites): until this connection has had a
        round, asked with `{"history": true}`, so the first reply carries the agent's kept
        rounds and one connection judges a site's trend (DESIGN §13), as a first `sample`
        carries every step mark still buffered.  An agent that predates it ignores the
        argument and sends the newest round alone."""
        args = None if self._sites_history_read else {"history": True}
        result = self.request("sites", args, timeout)
        if result.get("enabled") is True:
            self._sites_history_read = True
        return result

    def sample(
        self, timeout: float | None = None, max_marks: int | None = None, columns: bool = False
    ) -> AgentSample:
        """The agent's counters and the step marks since this connection's last sample: all
        still buffered, or the newest `max_marks` of them; `columns`: sent as columns, not an
        object per mark (the same marks; an agent that predates the layout sends rows)."""
        deadline = time.monotonic() + (timeout or self.timeout)
        return self.send_sample(deadline, max_marks, columns).wait_then(parse_sample)

    def send_sample(
        self,
        deadline: float | None = None,
        max_marks: int | None = None,
        columns: bool = False,
        wait_to_send: bool = True,
    ) -> PendingReply:
        """`sample` sent (see `send`); its result, read through the PendingReply, goes to
        parse_sample."""
        args: dict[str, Any] = {}
        if max_marks is not None:
            args["max_marks"] = max_marks
        if columns:
            args["mark_layout"] = "columns"
        return self.send("sample", args, deadline, wait_to_send)

    def abort(self) -> None:
        """Wake a request blocked in another thread (it fails at once); used on shutdown."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        self._decoder = protocol.FrameDecoder()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
