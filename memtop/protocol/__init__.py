"""The agent socket protocol (DESIGN §6): framing, schema checks, the socket directory, peers.

Frames are a 4-byte big-endian length followed by one UTF-8 JSON object.  Both sides use this
module, so a third-party agent (a JAX one, a test double) only has to match what is written here.
Nothing in this module imports torch or touches the GPU.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import socket
import stat
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memtop.model import (
    AgentBreakdown,
    AgentCleanup,
    AgentDevice,
    AgentDeviceSample,
    AgentHello,
    AgentResetPeak,
    AgentSample,
    AgentSites,
    AgentSnapshot,
    HostMemory,
    Site,
    SiteUsage,
    StepMark,
)
from memtop.protocol import namespaces, nesting

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 1 << 20
# Deepest nesting of arrays/objects a frame may carry.  The wire schema needs 4 levels; the limit
# keeps json (and everything that walks the result) far from the interpreter's recursion limit.
MAX_DEPTH = 64
_HEADER = struct.Struct(">I")

# The closed command set: nothing else is ever executed on behalf of a peer.
# The torch.cuda.memory_stats() keys every `sample` must carry (DESIGN §6 allows a documented
# subset of torch's keys): all that memtop, its JSON report and its exporter read.
SAMPLE_STAT_KEYS: tuple[str, ...] = (
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "reserved_bytes.all.current",
    "reserved_bytes.all.peak",
    "reserved_bytes.large_pool.current",
    "active_bytes.all.current",
    "requested_bytes.all.current",
    "inactive_split_bytes.all.current",
    "inactive_split_bytes.large_pool.current",
    "allocation.all.current",
    "segment.all.current",
    "num_alloc_retries",
    "num_ooms",
    "num_device_alloc",
    "num_device_free",
)

COMMANDS = frozenset({"hello", "sample", "breakdown", "snapshot", "cleanup", "reset_peak", "sites"})

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


class UnsafeSocketDir(Exception):
    """The socket directory exists but is not safe to use (owner or permissions)."""


class PeerRefused(Exception):
    """The process serving an agent socket is not who the socket says it is (or the socket or
    its directory is not what a real agent makes); the message is one line."""


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
            yield decode_body(body)

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
# Text from a peer

# C0 and C1 controls, DEL, the line and paragraph separators (str.splitlines breaks on them:
# one line would become two), and the format characters that reorder or hide text (bidi marks,
# overrides and isolates, zero-width characters): none of them may reach a terminal from a peer.
_CONTROL = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]"
)
MAX_TEXT = 4096
# Lone surrogates: what Python makes of bytes that are not UTF-8 in an argv, a file name or an
# environment (surrogateescape), and what a JSON `\udcxx` escape decodes to.  No UTF-8 encoder
# takes them: one in a command line blanked the exporter (HTTP 500 on every scrape) and crashed
# every text output, so they are written out as text where they enter.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _escape_surrogate(match: re.Match[str]) -> str:
    code = ord(match.group())
    # U+DC80..U+DCFF stand for the bytes 0x80..0xFF that were not UTF-8: show the byte, as
    # Python's backslashreplace does (`caf\xe9.bin`); any other lone surrogate by its number.
    return f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x}"


def clean_text(value: object, limit: int = MAX_TEXT) -> str:
    """A peer's string made inert for any terminal and encodable as UTF-8: control characters
    become `?`, lone surrogates their escape (`\\xe9`), and it is cut at `limit` characters.
    Every string memtop takes from an agent, a recording, an OOM report, the driver or another
    process's command line passes through here, once, where it enters."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return _SURROGATE.sub(_escape_surrogate, _CONTROL.sub("?", text))


def _clean_str(text: str) -> str:
    # Every character _CONTROL or _SURROGATE matches is one str.isprintable() refuses (Cc, Cf,
    # Zl, Zp, Cs), so a printable string within the limit is already clean: the C check spares
    # the regex and the copy for nearly every string an agent sends (key names, GPU names).
    if len(text) <= MAX_TEXT and text.isprintable():
        return text
    return clean_text(text)


# A PCI address: [domain:]bus:device[.function], hexadecimal.
_PCI_BUS_ID = re.compile(
    r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.([0-7]))?", re.ASCII
)


def canonical_pci_bus_id(text: object) -> str | None:
    """A PCI address the way memtop compares them, "dddd:bb:dd.f" in lower case; None for
    anything that is not one.  NVML writes "00000000:3B:00.0", amdsmi "0000:c1:00.0", torch
    gives numbers (pci_bus_id_of): one form, so that a driver's device and an agent's meet."""
    if not isinstance(text, str) or len(text) > 32:
        return None
    match = _PCI_BUS_ID.fullmatch(text.strip())
    if match is None:
        return None
    domain, bus, device, function = match.groups()
    return pci_bus_id_of(int(domain or "0", 16), int(bus, 16), int(device, 16), int(function or 0))


def pci_bus_id_of(domain: int, bus: int, device: int, function: int = 0) -> str:
    """The canonical address of these numbers (torch's pci_domain_id, pci_bus_id, pci_device_id;
    it gives no function number: a GPU is function 0)."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function:x}"


_SCALARS = frozenset({int, float, bool, type(None)})  # nothing in them to clean


def clean_value(value: Any, depth: int = 0) -> Any:
    """A decoded reply with every string (keys included) passed through clean_text.

    Containers in which nothing needed cleaning are returned as they are, not copied: a
    viewer's first `sample` carries a thousand step marks per agent, and a second copy of them
    was most of the viewer's peak memory."""
    if type(value) in _SCALARS:
        return value  # the bulk of a reply: numbers, checked first
    if isinstance(value, str):
        return _clean_str(str(value))
    if isinstance(value, dict):
        changed = False
        pairs = []
        for key, item in value.items():
            clean_key = _clean_str(key) if type(key) is str else clean_text(key)
            clean_item = item if type(item) in _SCALARS else clean_value(item, depth + 1)
            changed = changed or clean_key is not key or clean_item is not item
            pairs.append((clean_key, clean_item))
        return dict(pairs) if changed else value
    if isinstance(value, list):
        if _SCALARS.issuperset(map(type, value)):
            return value  # a column of step marks: numbers only, checked at C speed
        items = [clean_value(item, depth + 1) for item in value]
        return items if any(a is not b for a, b in zip(items, value, strict=True)) else value
    return value


# --------------------------------------------------------------------------------------------
# Requests and replies


def error_reply(request_id: Any, code: str, message: str) -> dict[str, Any]:
    return {"id": request_id, "error": {"code": code, "message": message}}


@dataclass(frozen=True, slots=True)
class Request:
    id: int | str
    cmd: str
    args: Mapping[str, Any]


def parse_request(message: Mapping[str, Any]) -> Request:
    """Check a request's shape; raise ProtocolError with the id-less code when it is wrong."""
    request_id = message.get("id")
    if isinstance(request_id, bool) or not isinstance(request_id, int | str):
        raise ProtocolError(E_BAD_REQUEST, "request needs an integer or string 'id'")
    cmd = message.get("cmd")
    if not isinstance(cmd, str):
        raise ProtocolError(E_BAD_REQUEST, "request needs a string 'cmd'")
    if cmd not in COMMANDS:
        raise ProtocolError(E_UNKNOWN_COMMAND, f"unknown command {cmd[:40]!r}")
    args = message.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError(E_BAD_REQUEST, "'args' must be an object")
    return Request(request_id, cmd, args)


def _require(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise ProtocolError("bad_reply", f"{where}: field {key!r} missing or of the wrong type")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


MAX_DEVICES = 64
MAX_ARGV = 256
MAX_STATS = 1024
MAX_MARKS = 8192


def _bounded(items: list[Any], limit: int, what: str) -> list[Any]:
    if len(items) > limit:
        raise ProtocolError("bad_reply", f"{what}: {len(items)} entries, more than {limit}")
    return items


def _count(obj: Mapping[str, Any], key: str, where: str) -> int:
    value = _require(obj, key, int, where)
    if value < 0:
        raise ProtocolError("bad_reply", f"{where}: field {key!r} is negative")
    return int(value)


def parse_hello(result: Mapping[str, Any]) -> AgentHello:
    """Validate a `hello` result against the wire schema and turn it into an AgentHello.

    Every string is cleaned of control characters here (clean_text), so whatever shows it, in
    whatever output mode, shows inert text.
    """
    protocol = _require(result, "protocol", int, "hello")
    pid = _require(result, "pid", int, "hello")
    argv = _bounded(_require(result, "argv", list, "hello"), MAX_ARGV, "hello argv")
    python = _require(result, "python", str, "hello")
    torch_version = result.get("torch")
    if torch_version is not None and not isinstance(torch_version, str):
        raise ProtocolError("bad_reply", "hello: field 'torch' must be a string or null")
    conf = _require(result, "allocator_conf", str, "hello")
    devices = []
    for raw in _bounded(_require(result, "devices", list, "hello"), MAX_DEVICES, "hello devices"):
        if not isinstance(raw, dict):
            raise ProtocolError("bad_reply", "hello: each device must be an object")
        devices.append(
            AgentDevice(
                index=_count(raw, "index", "hello device"),
                uuid=clean_text(_require(raw, "uuid", str, "hello device"), 96),
                name=clean_text(_require(raw, "name", str, "hello device"), 96),
                total_bytes=_count(raw, "total_bytes", "hello device"),
                # Optional (an agent before 0.x, or torch without PCI numbers, leaves it out);
                # anything but an address is ignored rather than refused.
                pci_bus_id=canonical_pci_bus_id(raw.get("pci_bus_id")),
            )
        )
    known = {"protocol", "pid", "argv", "python", "torch", "allocator_conf", "devices"}
    return AgentHello(
        protocol=protocol,
        pid=pid,
        argv=tuple(clean_text(a) for a in argv),
        python=clean_text(python, 200),
        torch=None if torch_version is None else clean_text(torch_version, 200),
        allocator_conf=clean_text(conf, 1000),
        devices=tuple(devices),
        extra={clean_text(k, 100): clean_value(v) for k, v in result.items() if k not in known},
    )


def _finite(obj: Mapping[str, Any], key: str, where: str) -> float:
    value = float(_require(obj, key, (int, float), where))
    if not math.isfinite(value):
        raise ProtocolError("bad_reply", f"{where}: field {key!r} is not a finite number")
    return value


def mark_columns(marks: list[dict[str, Any]]) -> dict[str, Any]:
    """Step marks as columns (`sample` with `mark_layout: "columns"`): one list per field, and
    for a per-device field one list per device, null where a mark lacks that device.

    The same numbers as the rows, without an object per mark and per device: 1024 marks decode
    into 0.19 MB instead of 0.89 MB (tracemalloc), and the dashboard's RSS against 8 agents
    with full buffers no longer jumps to 62-68 MB in its first round (52-56 MB)."""
    # The three columns every reader needs are there even with no marks (a trainer between
    # steps, or one that never steps).
    # Whole columns by comprehension (C speed): the agent thread builds 1024 marks' worth once
    # per new viewer, and a loop over every field of every mark cost 2.5× as much as rows.
    columns: dict[str, Any] = {"step": [], "time": [], "allocated_bytes": {}}
    for key in set().union(*marks) if marks else ():
        values = [mark.get(key) for mark in marks]
        if any(isinstance(value, dict) for value in values):
            maps = [value if isinstance(value, dict) else {} for value in values]
            devices = set().union(*maps)
            columns[key] = {device: [m.get(device) for m in maps] for device in sorted(devices)}
        else:
            columns[key] = values
    return columns


def _marks_from_columns(columns: object) -> list[StepMark]:
    where = "sample step_mark_columns"
    if not isinstance(columns, dict):
        raise ProtocolError("bad_reply", f"{where}: must be an object")
    steps = _require(columns, "step", list, where)
    times = _require(columns, "time", list, where)
    allocated = _require(columns, "allocated_bytes", dict, where)
    count = len(_bounded(steps, MAX_MARKS, where))
    if len(times) != count or len(allocated) > MAX_DEVICES:
        raise ProtocolError("bad_reply", f"{where}: columns of different lengths")
    # The optional host memory columns (agents before them, or off Linux, send none).
    no_column = [None] * count
    host_rss = _optional_column(columns, "host_rss_bytes", count, where) or no_column
    heap_free = _optional_column(columns, "host_heap_free_bytes", count, where) or no_column
    per_device: list[tuple[int, list[Any]]] = []
    for key, values in allocated.items():
        if not _index(key) or not isinstance(values, list) or len(values) != count:
            raise ProtocolError("bad_reply", f"{where}: bad 'allocated_bytes'")
        if any(
            v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0)
            for v in values
        ):
            raise ProtocolError("bad_reply", f"{where}: bad 'allocated_bytes'")
        per_device.append((int(key), values))
    marks = []
    for row, (step, when) in enumerate(zip(steps, times, strict=True)):
        if isinstance(step, bool) or not isinstance(step, int):
            raise ProtocolError("bad_reply", f"{where}: 'step' must hold ints")
        if isinstance(when, bool) or not isinstance(when, int | float) or not math.isfinite(when):
            raise ProtocolError("bad_reply", f"{where}: 'time' must hold finite numbers")
        marks.append(
            StepMark(
                step=step,
                time=float(when),
                allocated={i: v[row] for i, v in per_device if v[row] is not None},
                host_rss=_mark_bytes(host_rss[row], "host_rss_bytes", where),
                host_heap_free=_mark_bytes(heap_free[row], "host_heap_free_bytes", where),
            )
        )
    return marks


def _optional_column(columns: dict[str, Any], key: str, count: int, where: str) -> list[Any]:
    column = columns.get(key)
    if column is not None and (not isinstance(column, list) or len(column) != count):
        raise ProtocolError("bad_reply", f"{where}: bad {key!r}")
    return column or []


def _mark_bytes(value: object, key: str, where: str) -> int | None:
    """An optional byte count of a step mark: None, or an int >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProtocolError("bad_reply", f"{where}: bad {key!r}")
    return value


def _host_memory(raw: object) -> HostMemory | None:
    """`sample`'s optional `host_memory` block: the process's RSS, its high-water mark and the
    machine's memory, in bytes (an agent without it, or off Linux, sends none)."""
    if raw is None:
        return None
    where = "sample host_memory"
    if not isinstance(raw, dict):
        raise ProtocolError("bad_reply", f"{where}: must be an object")
    total = _optional(raw, "total_bytes", int, where)
    if total is not None and total < 0:
        raise ProtocolError("bad_reply", f"{where}: field 'total_bytes' is negative")
    return HostMemory(
        rss_bytes=_count(raw, "rss_bytes", where),
        peak_rss_bytes=_count(raw, "peak_rss_bytes", where),
        total_bytes=total,
    )


def parse_sample(result: Mapping[str, Any]) -> AgentSample:
    """Validate a `sample` result against the wire schema and turn it into an AgentSample.

    The shape is checked here (types, bounds, no negative sizes); whether the numbers make sense
    together (allocated <= reserved <= total, counters that only grow) is the viewer's call, see
    memtop.sources.agents.
    """
    when = _finite(result, "time", "sample")
    step = result.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise ProtocolError("bad_reply", "sample: field 'step' must be an integer or null")
    devices = []
    for raw in _bounded(_require(result, "devices", list, "sample"), MAX_DEVICES, "sample devices"):
        if not isinstance(raw, dict):
            raise ProtocolError("bad_reply", "sample: each device must be an object")
        stats = _require(raw, "stats", dict, "sample device")
        if len(stats) > MAX_STATS:
            raise ProtocolError("bad_reply", f"sample: more than {MAX_STATS} stats")
        devices.append(
            AgentDeviceSample(
                index=_count(raw, "index", "sample device"),
                stats={
                    clean_text(k, 200): int(v)
                    for k, v in stats.items()
                    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                },
                free_bytes=_count(raw, "free_bytes", "sample device"),
                total_bytes=_count(raw, "total_bytes", "sample device"),
            )
        )
    columns = result.get("step_mark_columns")
    marks = [] if columns is None else _marks_from_columns(columns)
    raw_marks = result.get("step_marks") or []
    if not isinstance(raw_marks, list):
        raise ProtocolError("bad_reply", "sample: 'step_marks' must be a list")
    for raw in _bounded(raw_marks, MAX_MARKS, "sample step_marks"):
        if not isinstance(raw, dict):
            raise ProtocolError("bad_reply", "sample: each step mark must be an object")
        allocated = _require(raw, "allocated_bytes", dict, "step mark")
        if len(allocated) > MAX_DEVICES:
            raise ProtocolError("bad_reply", "step mark: too many devices")
        per_device = {}
        for k, v in allocated.items():
            if not _index(k) or isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ProtocolError("bad_reply", "step mark: bad 'allocated_bytes'")
            per_device[int(k)] = v
        marks.append(
            StepMark(
                step=_require(raw, "step", int, "step mark"),
                time=_finite(raw, "time", "step mark"),
                allocated=per_device,
                # The host memory figures (memtop.agent.host_memory): optional.
                host_rss=_mark_bytes(raw.get("host_rss_bytes"), "host_rss_bytes", "step mark"),
                host_heap_free=_mark_bytes(
                    raw.get("host_heap_free_bytes"), "host_heap_free_bytes", "step mark"
                ),
            )
        )
    oom = result.get("oom")
    return AgentSample(
        time=when,
        step=step,
        devices=tuple(devices),
        step_marks=tuple(marks),
        oom=clean_value(oom) if isinstance(oom, dict) and oom.get("ooms") else None,
        host_memory=_host_memory(result.get("host_memory")),
    )


def _optional(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in _as_tuple(kind):
        raise ProtocolError("bad_reply", f"{where}: field {key!r} has the wrong type")
    if not isinstance(value, kind):
        raise ProtocolError("bad_reply", f"{where}: field {key!r} has the wrong type")
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError("bad_reply", f"{where}: field {key!r} is not a finite number")
    return value


def _index(key: object) -> bool:
    """A device-index key: ASCII digits only."""
    return isinstance(key, str) and decimal(key) is not None


def decimal(text: str) -> int | None:
    """`text` as a non-negative integer when it is ASCII digits only, else None.  str.isdigit
    also takes "²" (which int() refuses: a file named `².sock`, or a directory `/tmp/memtop-²`
    that anyone can make, would stop the scan) and other scripts' digits (which int() reads:
    `٠` would pass for uid 0)."""
    return int(text) if text.isascii() and text.isdigit() else None


def _device_map(raw: Any, where: str, numbers: type | tuple[type, ...] = int) -> dict[int, Any]:
    """`{"<index>": value}` with digit keys, at most MAX_DEVICES of them."""
    if not isinstance(raw, dict):
        raise ProtocolError("bad_reply", f"{where}: must be an object keyed by device index")
    if len(raw) > MAX_DEVICES:
        raise ProtocolError("bad_reply", f"{where}: more than {MAX_DEVICES} devices")
    out: dict[int, Any] = {}
    for key, value in raw.items():
        if not _index(key):
            raise ProtocolError("bad_reply", f"{where}: device key {clean_text(key, 20)!r}")
        if isinstance(value, bool) or not isinstance(value, numbers):
            raise ProtocolError("bad_reply", f"{where}: device {key} has the wrong type")
        if isinstance(value, float) and not math.isfinite(value):
            raise ProtocolError("bad_reply", f"{where}: device {key} is not finite")
        out[int(key)] = value
    return out


def _figures(raw: Any, where: str) -> dict[str, Any]:
    """A flat object of named numbers (bytes, counts, ratios); other values are left out."""
    if not isinstance(raw, dict):
        raise ProtocolError("bad_reply", f"{where}: must be an object")
    if len(raw) > MAX_STATS:
        raise ProtocolError("bad_reply", f"{where}: more than {MAX_STATS} fields")
    return {
        clean_text(k, 100): v
        for k, v in raw.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def parse_breakdown(result: Mapping[str, Any]) -> AgentBreakdown:
    """Validate a `breakdown` result: `{"time", "step", "devices": {"<index>": {role: bytes}}}`
    (`"pending": true` while the trainer's next step boundary has not measured it)."""
    pending = result.get("pending") is True
    devices = {}
    for index, parts in _device_map(result.get("devices", {}), "breakdown devices", dict).items():
        figures = _figures(parts, "breakdown device")
        if any(isinstance(v, float) or v < 0 for v in figures.values()):
            raise ProtocolError("bad_reply", "breakdown: bytes must be integers >= 0")
        devices[index] = figures
    measured = _optional(result, "measured", str, "breakdown")
    return AgentBreakdown(
        time=_optional(result, "time", (int, float), "breakdown"),
        step=_optional(result, "step", int, "breakdown"),
        pending=pending,
        devices=devices,
        measured=None if measured is None else clean_text(measured, 40),
    )


def parse_snapshot(result: Mapping[str, Any]) -> AgentSnapshot:
    """Validate a `snapshot` result: the per-device summary (segments, reserved, allocated,
    fragmentation figures, DESIGN §4) and, when a file was asked for, its path and size."""
    devices = {
        index: _figures(summary, "snapshot device")
        for index, summary in _device_map(
            result.get("devices", {}), "snapshot devices", dict
        ).items()
    }
    path = _optional(result, "path", str, "snapshot")
    size = _optional(result, "bytes", int, "snapshot")
    if size is not None and size < 0:
        raise ProtocolError("bad_reply", "snapshot: 'bytes' must be >= 0")
    return AgentSnapshot(
        time=_optional(result, "time", (int, float), "snapshot"),
        pending=result.get("pending") is True,
        devices=devices,
        path=None if path is None else clean_text(path, 4096),
        bytes=size,
    )


def parse_cleanup(result: Mapping[str, Any]) -> AgentCleanup:
    """Validate a `cleanup` result: bytes released / reserved before and after, per device."""
    released = _device_map(result.get("released_bytes", {}), "cleanup released_bytes")
    if any(v < 0 for v in released.values()):
        raise ProtocolError("bad_reply", "cleanup: released bytes must be >= 0")
    return AgentCleanup(
        released_bytes=released,
        reserved_before=_device_map(result.get("reserved_before", {}), "cleanup reserved_before"),
        reserved_after=_device_map(result.get("reserved_after", {}), "cleanup reserved_after"),
        gc_collected=_optional(result, "gc_collected", int, "cleanup"),
        at_step_boundary=result.get("at_step_boundary") is True,
        after_step=_optional(result, "after_step", int, "cleanup"),
        took_s=_optional(result, "took_s", (int, float), "cleanup"),
    )


def parse_reset_peak(result: Mapping[str, Any]) -> AgentResetPeak:
    """Validate a `reset_peak` result: `{"devices": [index, ...]}`."""
    raw = _bounded(_require(result, "devices", list, "reset_peak"), MAX_DEVICES, "reset_peak")
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in raw):
        raise ProtocolError("bad_reply", "reset_peak: devices must be indices >= 0")
    return AgentResetPeak(devices=tuple(raw))


MAX_SITES = 1024


def parse_sites(result: Mapping[str, Any]) -> AgentSites:
    """Validate a `sites` result (DESIGN §12): `{"enabled": bool, "time", "step", "sites":
    [{"device", "site": {"file", "line", "function", "text"}, "bytes", "blocks",
    "old_blocks"}]}`; every string cleaned, every number a count."""
    enabled = _require(result, "enabled", bool, "sites")
    raw = _bounded(_require(result, "sites", list, "sites"), MAX_SITES, "sites")
    entries = []
    for item in raw:
        if not isinstance(item, Mapping):
            raise ProtocolError("bad_reply", "sites: an entry is not an object")
        site = _require(item, "site", Mapping, "sites entry")
        counts = [
            _require(item, key, int, "sites entry")
            for key in ("device", "bytes", "blocks", "old_blocks")
        ]
        line = _require(site, "line", int, "site")
        if min([*counts, line]) < 0 or counts[3] > counts[2]:
            raise ProtocolError(
                "bad_reply", "sites: a negative count or more old blocks than blocks"
            )
        entries.append(
            SiteUsage(
                device=counts[0],
                site=Site(
                    file=clean_text(_require(site, "file", str, "site"), 1000),
                    line=line,
                    function=clean_text(_require(site, "function", str, "site"), 200),
                    text=clean_text(_require(site, "text", str, "site"), 400),
                ),
                bytes=counts[1],
                blocks=counts[2],
                old_blocks=counts[3],
            )
        )
    when = _optional(result, "time", (int, float), "sites")
    return AgentSites(
        enabled=enabled,
        time=None if when is None else float(when),
        step=_optional(result, "step", int, "sites"),
        sites=tuple(entries),
    )


REPLY_PARSERS = {
    "hello": parse_hello,
    "sample": parse_sample,
    "breakdown": parse_breakdown,
    "snapshot": parse_snapshot,
    "cleanup": parse_cleanup,
    "reset_peak": parse_reset_peak,
    "sites": parse_sites,
}


def parse_reply(cmd: str, result: Mapping[str, Any]) -> Any:
    """The typed model object of any command's result (ProtocolError if it breaks the schema)."""
    if not isinstance(result, Mapping):
        raise ProtocolError("bad_reply", f"{cmd}: the result must be an object")
    return REPLY_PARSERS[cmd](result)


# --------------------------------------------------------------------------------------------
# Socket directory and peers


def socket_dir(environ: Mapping[str, str] | None = None, uid: int | None = None) -> Path:
    """`$XDG_RUNTIME_DIR/memtop/`, else `/tmp/memtop-<uid>/` (override: MEMTOP_SOCKET_DIR).

    Of this process by default; `memtop attach` passes its target's environment and uid to
    know where the agent it starts there will listen."""
    environ = os.environ if environ is None else environ
    override = environ.get("MEMTOP_SOCKET_DIR")
    if override:
        return Path(override)
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "memtop"
    return Path(f"/tmp/memtop-{os.getuid() if uid is None else uid}")


def check_socket_dir(path: Path, owner: int | None = None) -> None:
    """Refuse a directory another user owns or others could write into (socket hijacking).

    `owner` is the uid the directory must belong to (default: ours; root viewing other users'
    trainers passes theirs).
    """
    owner = os.getuid() if owner is None else owner
    mine = owner == os.getuid()
    # Our own directory taken by someone else (anyone can make /tmp/memtop-<uid> first, where
    # XDG_RUNTIME_DIR is unset): the refusal says how to get out of it.
    elsewhere = (
        ": set XDG_RUNTIME_DIR (your login session's /run/user/<uid>), or MEMTOP_SOCKET_DIR to a "
        "directory you own with mode 0700"
        if mine
        else ""
    )
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UnsafeSocketDir(f"cannot inspect socket directory {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeSocketDir(
            f"socket directory {path} is not a directory (or is a symlink){elsewhere}"
        )
    if info.st_uid != owner:
        whom = "you" if mine else "uid"
        raise UnsafeSocketDir(
            f"socket directory {path} is owned by uid {info.st_uid}, not by {whom} ({owner})"
            f"{elsewhere}"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        fix = f" (chmod 700 {path})" if mine else ""
        raise UnsafeSocketDir(
            f"socket directory {path} is group- or world-writable "
            f"(mode {stat.S_IMODE(info.st_mode):o}); expected 700{fix}"
        )


def ensure_socket_dir(path: Path | None = None) -> Path:
    """Create the socket directory 0700 if needed and check it; raise UnsafeSocketDir if unsafe."""
    path = path or socket_dir()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UnsafeSocketDir(f"cannot create socket directory {path}: {exc.strerror}") from None
    check_socket_dir(path)
    return path


def state_dir() -> Path:
    """Where memtop keeps files that outlive a trainer and the login session (the runtime
    directory of the sockets is removed at logout): `$XDG_STATE_HOME/memtop`
    (`~/.local/state/memtop`); an overridden socket directory (MEMTOP_SOCKET_DIR: tests, custom
    setups) holds them instead."""
    if os.environ.get("MEMTOP_SOCKET_DIR"):
        return socket_dir()
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return Path(state) / "memtop"


def oom_dir() -> Path:
    """Where agents write OOM reports and `memtop oom` reads them: MEMTOP_OOM_DIR, else `oom/`
    in the state directory."""
    override = os.environ.get("MEMTOP_OOM_DIR")
    if override:
        return Path(override)
    return state_dir() / "oom"


def ensure_private_dir(path: Path) -> Path:
    """Create `path` (and missing parents) 0700 and check it under the socket directory's rules:
    ours, a real directory, not group- or world-writable.  Raise UnsafeSocketDir otherwise."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise UnsafeSocketDir(f"cannot create directory {path}: {exc.strerror}") from None
    check_socket_dir(path)
    return path


def discovery_dirs() -> list[tuple[Path, int]]:
    """Socket directories a viewer reads, each with the uid that must own it.

    A normal user reads their own; root (who may attach to anyone's trainer) reads every
    user's, so `sudo memtop` on a shared box sees all the agents.
    """
    mine = socket_dir()
    if os.geteuid() != 0 or os.environ.get("MEMTOP_SOCKET_DIR"):
        return [(mine, os.getuid())]
    found = {mine: os.getuid()}
    for pattern_root, prefix in ((Path("/tmp"), "memtop-"), (Path("/run/user"), "")):
        with contextlib.suppress(OSError):
            for entry in pattern_root.iterdir():
                uid = decimal(entry.name[len(prefix) :]) if entry.name.startswith(prefix) else None
                if uid is None:
                    continue
                path = entry if prefix else entry / "memtop"
                found.setdefault(path, uid)
    return sorted(found.items())


def socket_path(pid: int, directory: Path | None = None) -> Path:
    """The socket of the agent of `pid`, a process in this process's pid namespace: `<pid>.sock`
    in the host's, `<pid>.ns<inode>.sock` in a container's (see protocol.namespaces)."""
    return (directory or socket_dir()) / namespaces.socket_name(pid, namespaces.own_pid_namespace())


def socket_pid(name: str) -> int | None:
    """The pid an agent socket's file name `<pid>.sock` stands for; None for any other name."""
    stem, dot, ext = name.partition(".")
    if ext != "sock" or not dot or len(stem) > 9:
        return None
    return decimal(stem)


def pid_exists(pid: int) -> bool:
    """Whether a process `pid` exists, zombies included (one system call)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, belongs to someone else
    except OSError:
        return False
    return True


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a running process.  Zombies count as dead: an exited trainer that its
    parent has not reaped yet holds no GPU memory and serves no socket."""
    if not pid_exists(pid):
        return False
    try:
        # os.open/read, not open(): no buffered file object for one small read (half the cost;
        # a viewer asks this of every agent and simulated GPU every second).
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        proc_stat = os.read(fd, 4096)
    except OSError:
        return True
    finally:
        os.close(fd)
    # The state letter follows the last ')' (the command name may itself contain one).
    tail = proc_stat[proc_stat.rfind(b")") + 1 :].split()
    return not (tail and tail[0] in (b"Z", b"X"))


def list_agent_sockets(directory: Path | None = None, remove_stale: bool = True) -> list[int]:
    """Pids with a socket in the directory (of processes in this pid namespace, as their agents
    name them: protocol.namespaces); sockets of dead pids are removed on the way."""
    directory = directory or socket_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    own = namespaces.own_pid_namespace()
    pids = []
    for name in names:
        parsed = namespaces.parse_socket_name(name)
        if parsed is None or parsed[1] not in (None, own):
            continue
        pid = parsed[0]
        if pid_alive(pid):
            pids.append(pid)
        elif remove_stale:
            with contextlib.suppress(OSError):
                os.unlink(directory / name)
    return sorted(pids)


_PEERCRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected AF_UNIX socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


def peer_allowed(uid: int) -> bool:
    """Only the agent's own user, or root, may talk to it."""
    return uid == os.getuid() or uid == 0


def connect(pid: int, directory: Path | None = None, timeout: float = 2.0) -> socket.socket:
    """Connect to the agent of `pid` without checking who serves it (tests, the agent's own
    checks); viewers use connect_agent.  Raises OSError (ENOENT, ECONNREFUSED, EACCES) as is."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(socket_path(pid, directory)))
    except OSError:
        sock.close()
        raise
    return sock


def pid_owner(pid: int) -> int | None:
    """The real uid owning `pid` as /proc shows it (None: no such process visible here)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except (OSError, ValueError):
        return None


def check_socket_entry(path: Path, owner: int) -> None:
    """lstat one `<pid>.sock`: it must be a socket (not a symlink, not a file) owned by `owner`.
    Raises PeerRefused with the reason, or OSError (ENOENT) when it is not there."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise PeerRefused(f"{path} is a symlink; memtop never follows one")
    if not stat.S_ISSOCK(info.st_mode):
        raise PeerRefused(f"{path} is not a socket")
    if info.st_uid != owner:
        raise PeerRefused(f"{path} belongs to uid {info.st_uid}, not to the directory's ({owner})")


def check_peer(sock: socket.socket, pid: int, owner: int) -> None:
    """The server at the other end must be process `pid` running as `owner` (SO_PEERCRED)."""
    try:
        peer_pid, peer_uid, _ = peer_credentials(sock)
    except OSError as exc:
        raise PeerRefused(f"cannot read the credentials of the agent of pid {pid}: {exc}") from None
    if peer_pid != pid:
        raise PeerRefused(f"the socket of pid {pid} is served by pid {peer_pid}: impersonation")
    if peer_uid != owner:
        raise PeerRefused(
            f"the agent of pid {pid} runs as uid {peer_uid}, not as the directory's owner {owner}"
        )


def connect_agent(
    pid: int,
    directory: Path,
    owner: int | None = None,
    timeout: float = 2.0,
    name: str | None = None,
) -> socket.socket:
    """Connect to the agent of `pid` in `directory` (owned by `owner`, default: us) and make
    sure it is that agent: the directory and the socket are checked with lstat (no symlink
    followed), and the server's SO_PEERCRED must show pid `pid` and uid `owner`.  Nothing is
    sent before these checks pass.  Raises UnsafeSocketDir or PeerRefused (refused) or OSError
    (not reachable).

    `name`: the socket's file name when `pid` (as this viewer sees it) runs in another pid
    namespace (`<its pid>.ns<inode>.sock`); the server must then be `pid` AND be that process
    of that namespace (protocol.namespaces)."""
    owner = os.getuid() if owner is None else owner
    check_socket_dir(directory, owner)
    path = directory / name if name is not None else socket_path(pid, directory)
    check_socket_entry(path, owner)
    process_owner = pid_owner(pid)
    if process_owner is not None and process_owner != owner:
        raise PeerRefused(
            f"pid {pid} belongs to uid {process_owner}; a socket in uid {owner}'s directory "
            "cannot speak for it"
        )
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
        # The socket could have been swapped between lstat and connect (only by the directory's
        # owner, who could equally run a fake agent): the peer's credentials settle it.
        check_peer(sock, pid, owner)
        if name is not None and namespaces.expected_socket_name(pid) != name:
            raise PeerRefused(f"pid {pid} is not the process {name} stands for")
    except BaseException:
        sock.close()
        raise
    return sock


def describe_connect_error(pid: int, exc: OSError) -> str:
    """A one-line reason a viewer could not reach an agent (only what is known)."""
    if exc.errno == errno.ENOENT and not pid_alive(pid):
        return f"no process {pid}"
    if exc.errno == errno.ENOENT:
        return (
            f"no agent socket for pid {pid}: start it under `memtop run`, or add an agent with "
            f"`memtop attach {pid}`"
        )
    if exc.errno == errno.ECONNREFUSED:
        return f"nothing listens on the agent socket of pid {pid}: not reachable"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied on the agent socket of pid {pid} (another user's process)"
    if isinstance(exc, TimeoutError):
        return f"the agent of pid {pid} did not accept the connection in time: not reachable"
    return f"cannot reach the agent of pid {pid}: {exc.strerror or exc}"
