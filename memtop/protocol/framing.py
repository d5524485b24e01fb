"""Frames on the agent socket (DESIGN §6): a 4-byte big-endian length, then one UTF-8 JSON
object of at most 1 MiB; the request envelope (`id`, `cmd`, `args`) and the error codes.

Both sides use it: the agent inside the trainer (stdlib only, nothing of the viewer) and the
viewer's agent client.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Collection, Iterator, Mapping
from typing import Any

from memtop.base.records import record
from memtop.protocol import nesting

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 1 << 20
# Deepest nesting of arrays/objects a frame may carry.  The wire schema needs 4 levels; the limit
# keeps json (and everything that walks the result) far from the interpreter's recursion limit.
MAX_DEPTH = 64
_HEADER = struct.Struct(">I")

# Error codes carried in error frames.
E_BAD_FRAME = "bad_frame"
E_BAD_REQUEST = "bad_request"
E_UNKNOWN_COMMAND = "unknown_command"
E_FRAME_TOO_LARGE = "frame_too_large"
E_RATE_LIMITED = "rate_limited"
E_FAILED = "failed"
E_UNAVAILABLE = "unavailable"


class ProtocolError(Exception):
    """A frame or message that does not follow the protocol; `code` is one of the E_* codes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ConnectionClosed(Exception):
    """The peer closed the connection (cleanly or in the middle of a frame)."""


# --------------------------------------------------------------------------------------------
# Framing


def encode_frame(message: Mapping[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(E_FRAME_TOO_LARGE, f"frame of {len(body)} bytes exceeds 1 MiB")
    return _HEADER.pack(len(body)) + body


def _check_depth(body: bytes, limit: int = MAX_DEPTH) -> None:
    """Refuse nesting deeper than `limit` before json sees it (json recurses once per level):
    a linear scan that builds nothing (memtop.protocol.nesting), a few µs for a request."""
    if nesting.nests_deeper_than(body, limit):
        raise ProtocolError(E_BAD_FRAME, f"frame nests deeper than {limit} levels")


def check_depth(body: bytes, limit: int = MAX_DEPTH) -> None:
    """Refuse (ProtocolError) JSON nesting deeper than `limit`, for any untrusted JSON read
    outside the socket (recordings, OOM reports): json and clean_value recurse per level."""
    _check_depth(body, limit)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def decode_body(body: bytes) -> dict[str, Any]:
    """One frame's JSON object; ProtocolError for anything else (too large, too deep, NaN,
    invalid UTF-8), never another exception."""
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(E_FRAME_TOO_LARGE, f"frame of {len(body)} bytes exceeds 1 MiB")
    _check_depth(body)
    try:
        message = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(E_BAD_FRAME, f"frame is not UTF-8 JSON: {exc}"[:200]) from None
    except RecursionError:
        raise ProtocolError(E_BAD_FRAME, "frame nests too deeply") from None
    if not isinstance(message, dict):
        raise ProtocolError(E_BAD_FRAME, "frame is not a JSON object")
    return message


class FrameDecoder:
    """Incremental decoder: feed it bytes as they arrive, take whole messages out.

    Used by the agent's non-blocking server loop, where a frame can arrive in pieces from
    several viewers at once.
    """

    def __init__(self, max_frame: int = MAX_FRAME_BYTES) -> None:
        self._buffer = bytearray()
        self._max_frame = max_frame
        # The bytes of the frame `feed` just yielded (read it at the yield: the next frame
        # replaces it), for a reader that asks whether they need cleaning (text.inert_json;
        # the viewer asks of its replies, the agent never does).
        self.last_body = b""

    def feed(self, data: bytes) -> Iterator[dict[str, Any]]:
        """Yield each complete message; raise ProtocolError on an oversize or malformed frame."""
        self._buffer += data
        while len(self._buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buffer)
            if length > self._max_frame:
                raise ProtocolError(
                    E_FRAME_TOO_LARGE, f"frame of {length} bytes exceeds {self._max_frame} bytes"
                )
            if len(self._buffer) < _HEADER.size + length:
                return
            body = bytes(self._buffer[_HEADER.size : _HEADER.size + length])
            del self._buffer[: _HEADER.size + length]
            message = decode_body(body)
            self.last_body = body
            yield message

    @property
    def pending_bytes(self) -> int:
        return len(self._buffer)

    @property
    def missing_bytes(self) -> int:
        """How many bytes the frame begun in the buffer still lacks (0: none begun): a reader
        can take them in one read instead of many small ones."""
        if len(self._buffer) < _HEADER.size:
            return 0
        (length,) = _HEADER.unpack_from(self._buffer)
        return max(0, _HEADER.size + min(length, self._max_frame) - len(self._buffer))


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise ConnectionClosed("connection closed by peer")
        chunks += chunk
    return bytes(chunks)


def recv_message(sock: socket.socket, max_frame: int = MAX_FRAME_BYTES) -> dict[str, Any]:
    """Read one frame from a blocking socket (the viewer side)."""
    (length,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    if length > max_frame:
        raise ProtocolError(E_FRAME_TOO_LARGE, f"frame of {length} bytes exceeds 1 MiB")
    return decode_body(_recv_exactly(sock, length))


def send_message(sock: socket.socket, message: Mapping[str, Any]) -> None:
    sock.sendall(encode_frame(message))


# --------------------------------------------------------------------------------------------
# Requests


@record(frozen=True, slots=True)
class Request:
    """A request as read from a peer, its shape checked (parse_request)."""

    id: int | str
    cmd: str
    args: Mapping[str, Any]


def parse_request(message: Mapping[str, Any], commands: Collection[str]) -> Request:
    """Check a request's shape; raise ProtocolError with the id-less code when it is wrong.
    `commands`: the closed set served, nothing else is ever executed on behalf of a peer (an
    agent passes its dispatch table, memtop.agent.handlers.HANDLERS)."""
    request_id = message.get("id")
    if isinstance(request_id, bool) or not isinstance(request_id, int | str):
        raise ProtocolError(E_BAD_REQUEST, "request needs an integer or string 'id'")
    cmd = message.get("cmd")
    if not isinstance(cmd, str):
        raise ProtocolError(E_BAD_REQUEST, "request needs a string 'cmd'")
    if cmd not in commands:
        raise ProtocolError(E_UNKNOWN_COMMAND, f"unknown command {cmd[:40]!r}")
    args = message.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError(E_BAD_REQUEST, "'args' must be an object")
    return Request(request_id, cmd, args)
