"""The record file: everything the sampler read, with timestamps (DESIGN §11).

One gzip stream of JSON lines, written as it goes.  Line 1 is a header
`{"memtop_record": 1, "version", "host", "started"}`; every other line is one thing the sampler
read, with `t` (unix seconds) and `src`:

- `{"t", "src": "nvml", "reading": {...DriverReading...}}` — a driver (or stand-in) reading;
- `{"t", "src": "processes", "processes": [{...ProcessInfo...}]}` — owners and command lines;
- `{"t", "src": "agent", "pid", "cmd": "hello"|"sample"|"breakdown"|"snapshot"|"sites",
  "reply": {"result": {...}}}` — an agent's reply as it came over the wire (the commands
  memtop.protocol.commands marks `recorded`);
- `{"t", "src": "agent", "pid", "state": "exited"|..., "error"}` — an agent that went away.

The writer flushes the compressor (a zlib sync flush) at least every FLUSH_S seconds, so a crash
loses at most that much; the reader takes a stream cut anywhere (no gzip trailer, half a line)
and returns every whole line before the cut.  `gzip -dc` reads a cleanly closed file.

The agent wire recordings of `shared/traces` (one file per agent, lines `{"t", "cmd", "reply"}`,
or `{"t", "error"}` when the trainer died) are read by the same reader.
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import json
import math
import os
import socket
import stat
import threading
import time
import types
import typing
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from memtop._version import __version__
from memtop.base import untrusted
from memtop.base.errors import MemtopError
from memtop.model import DeviceReading, DriverReading, GpuProcess, MigInfo
from memtop.protocol.text import clean_text, clean_value, inert_json
from memtop.sources.processes import ProcessInfo

RECORD_FORMAT = 1
FLUSH_S = 1.0
READ_CHUNK = 1 << 16
MAX_LINE = 8 << 20  # a line longer than this is not one of ours


class RecordError(MemtopError):
    """A file that is not a recording memtop can read (one line, for the user)."""


# ------------------------------------------------------------------ writing


class RecordWriter:
    """Appends lines to a gzip stream; thread-safe (agent replies arrive on worker threads)."""

    def __init__(self, path: Path, *, overwrite: bool = False, flush_s: float = FLUSH_S) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        if not overwrite:
            flags |= os.O_EXCL
        # A directory is not a file to overwrite: "exists; add --force" then "Is a directory"
        # were two wrong answers in a row.
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(os.lstat(path).st_mode):
                raise RecordError(
                    f"{path} is a directory: name a file to record to, e.g. {path / 'run.memtop'}"
                )
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            raise RecordError(f"{path} exists; add --force to overwrite it") from None
        except OSError as exc:
            raise RecordError(f"cannot write {path}: {exc.strerror or exc}") from None
        self.path = path
        self._file: IO[bytes] = os.fdopen(fd, "wb")
        self._compressor = zlib.compressobj(6, zlib.DEFLATED, 31)  # 31: a gzip wrapper
        self._lock = threading.Lock()
        self._flush_s = flush_s
        self._last_flush = time.monotonic()
        self._closed = False
        self.lines = 0
        self.write(
            {
                "memtop_record": RECORD_FORMAT,
                "version": __version__,
                "host": socket.gethostname(),
                "started": time.time(),
            }
        )
        self.flush()

    def write(self, line: dict[str, Any]) -> None:
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._closed:
                return
            self._file.write(self._compressor.compress(data))
            self.lines += 1
            if time.monotonic() - self._last_flush >= self._flush_s:
                self._flush_locked()

    def flush(self) -> None:
        with self._lock:
            if not self._closed:
                self._flush_locked()

    def _flush_locked(self) -> None:
        # A sync flush ends the deflate block on a byte boundary: everything written so far can
        # be decompressed from the file as it is now.
        self._file.write(self._compressor.flush(zlib.Z_SYNC_FLUSH))
        self._file.flush()
        self._last_flush = time.monotonic()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._file.write(self._compressor.flush(zlib.Z_FINISH))
            self._file.close()

    # What the sampler read, in the record's line shapes.

    def driver(self, when: float, reading: DriverReading) -> None:
        self.write({"t": when, "src": "nvml", "reading": dataclasses.asdict(reading)})

    def processes(self, when: float, processes: dict[int, ProcessInfo]) -> None:
        rows = [dataclasses.asdict(p) for p in processes.values()]
        self.write({"t": when, "src": "processes", "processes": rows})

    def agent_reply(self, pid: int, cmd: str, result: dict[str, Any]) -> None:
        self.write(
            {"t": time.time(), "src": "agent", "pid": pid, "cmd": cmd, "reply": {"result": result}}
        )

    def agent_state(self, when: float, pid: int, state: str, error: str | None) -> None:
        self.write({"t": when, "src": "agent", "pid": pid, "state": state, "error": error})


# ------------------------------------------------------------------ reading

# A recording is a file someone hands you: reading it is bounded in bytes and lines (a 49 KB
# gzip of `{}` lines decompressed to 50 MB and held 16 M skipped lines: 58 s and 2.7 GB).
# An agent records about 36 MB and 7 000 lines an hour (the H100 traces), which replay holds
# in about three times the memory: the byte cap is 7 agent-hours; the line cap bounds the time
# of tiny lines (5 us each).  Both are for one replay, all files of a folder together.
MAX_RECORDING_BYTES = 256 << 20  # decompressed
MAX_RECORDING_LINES = 1_000_000
OUT_CHUNK = 1 << 20  # decompressed at a time: a bomb inflates a chunk at most this far


class LineTally:
    """What a reader read and passed over, across the files of one replay: bytes and lines
    read (the caps hold for all of them), every skipped line counted and the first KEEP kept
    with why, and a note (one line) for each file it stopped reading early."""

    KEEP = 20

    def __init__(self) -> None:
        self.bytes_read = 0
        self.lines_read = 0
        self.count = 0
        self.examples: list[str] = []
        self.notes: list[str] = []
        self.file_lines = 0  # lines read of the file read last (memtop.sources.replay reads twice)

    @property
    def exhausted(self) -> bool:
        return self.bytes_read >= MAX_RECORDING_BYTES or self.lines_read >= MAX_RECORDING_LINES

    def skip(self, path: Path, number: int, why: str) -> None:
        self.count += 1
        if len(self.examples) < self.KEEP:  # formatted only when kept: 2 M of them add up
            self.examples.append(clean_text(f"{path}:{number}: {why}", 300))


def read_lines(
    path: Path, tally: LineTally | None = None, max_lines: int | None = None
) -> Iterator[dict[str, Any]]:
    """Every whole JSON line of a gzip'd (or plain) JSON-lines file, tolerating a cut tail
    (see read_marked_lines)."""
    return (line for line, _ in _read_lines(path, tally, max_lines, mark=False))


def read_marked_lines(
    path: Path, tally: LineTally | None = None, max_lines: int | None = None
) -> Iterator[tuple[dict[str, Any], bool]]:
    """Every whole JSON line of a gzip'd (or plain) JSON-lines file, tolerating a cut tail,
    each with whether every string in it is clean as it is (text.inert_json of its bytes:
    clean_value would return any part of it unchanged, and replay spares the walk).

    Concatenated gzip members are read one after the other; a member cut short (a recorder that
    crashed) yields what was flushed before the cut.  A line that is not a JSON object ends the
    file if it is the last one (half-written), else is an error; a line with a number out of
    range is skipped (counted in `tally`).  Only a regular file is read (a FIFO hung replay for
    good), and only up to MAX_RECORDING_BYTES / MAX_RECORDING_LINES in all the files `tally`
    has counted (a note in `tally` where reading stopped).  `tally.file_lines` says how many
    lines of this file were read; `max_lines` reads no more than that many (a second reading
    of a file stops where the first did).
    """
    return _read_lines(path, tally, max_lines, mark=True)


def _read_lines(
    path: Path, tally: LineTally | None, max_lines: int | None, *, mark: bool
) -> Iterator[tuple[dict[str, Any], bool]]:
    tally = tally if tally is not None else LineTally()
    try:
        handle = untrusted.open_regular(path)
    except OSError as exc:
        raise RecordError(f"cannot read {path}: {exc.strerror or exc}") from None
    except untrusted.UntrustedInput as exc:
        raise RecordError(f"{path} {exc}") from None
    with handle:
        head = handle.read(2)
        handle.seek(0)
        chunks = (
            _gunzip(handle, path)
            if head == b"\x1f\x8b"
            else iter(lambda: handle.read(OUT_CHUNK), b"")
        )
        pending = b""
        number = tally.file_lines = 0
        for chunk in chunks:
            tally.bytes_read += len(chunk)
            if tally.bytes_read > MAX_RECORDING_BYTES:
                tally.notes.append(
                    f"{path}: read up to line {number}: a replay reads "
                    f"{MAX_RECORDING_BYTES >> 20} MiB at most"
                )
                return
            pending += chunk
            *whole, pending = pending.split(b"\n")
            if len(pending) > MAX_LINE:
                raise RecordError(f"{path}: a line longer than {MAX_LINE} bytes")
            for raw in whole:
                if max_lines is not None and number >= max_lines:
                    return
                number = tally.file_lines = number + 1
                tally.lines_read += 1
                if tally.lines_read > MAX_RECORDING_LINES:
                    tally.notes.append(
                        f"{path}: read up to line {number - 1}: a replay reads "
                        f"{MAX_RECORDING_LINES:,} lines at most"
                    )
                    tally.file_lines = number - 1
                    return
                if raw.strip():
                    line = _parse_line(raw, path, number, tally)
                    if line is not None:
                        yield line, mark and inert_json(raw)
        # A last line without its newline: whole if it parses, else the cut of a crash.
        if pending.strip() and (max_lines is None or number < max_lines):
            tally.file_lines = number + 1
            with contextlib.suppress(RecordError):
                line = _parse_line(pending, path, number + 1, tally)
                if line is not None:
                    yield line, mark and inert_json(pending)


def _parse_line(raw: bytes, path: Path, number: int, tally: LineTally) -> dict[str, Any] | None:
    try:
        line = untrusted.loads(raw)
    except untrusted.OutOfRange as exc:  # a bad value in one line, not a bad file
        tally.skip(path, number, str(exc))
        return None
    except untrusted.UntrustedInput as exc:  # nests too deep, or not JSON at all
        raise RecordError(f"{path}: line {number} {exc}") from None
    if not isinstance(line, dict):
        raise RecordError(f"{path}: line {number} is not a JSON object")
    return line


def _gunzip(handle: IO[bytes], path: Path) -> Iterator[bytes]:
    decompressor = zlib.decompressobj(31)
    while True:
        data = handle.read(READ_CHUNK)
        if not data:
            return  # a cut stream: what was decompressed so far is all there is
        while True:
            try:
                out = decompressor.decompress(data, OUT_CHUNK)
            except zlib.error as exc:
                raise RecordError(f"{path}: not a readable gzip file ({exc})") from None
            if out:
                yield out
            if decompressor.eof:
                data = decompressor.unused_data
                decompressor = zlib.decompressobj(31)
                if data[:2] not in (b"", b"\x1f\x8b"):
                    return  # trailing garbage after the last member: ignore, as gzip does
                if not data:
                    break
            else:
                data = decompressor.unconsumed_tail
                if not data and len(out) < OUT_CHUNK:
                    break  # all of this chunk is out: read the next


# ------------------------------------------------------------------ decoding what was recorded


# A record file is input like any other: every string in it (GPU names, error lines, command
# lines, owners) is made inert, and every field must have its dataclass's type, here, before any
# output mode sees it.  A line that breaks this raises ValueError or TypeError (a skipped line).


def decode_reading(data: dict[str, Any], *, inert: bool = False) -> DriverReading:
    """`inert`: every string in `data` is clean already (read_marked_lines)."""
    data = data if inert else clean_value(data)
    devices = tuple(
        DeviceReading(
            **{
                **_typed(DeviceReading, d),
                "processes": tuple(_list(GpuProcess, d.get("processes", []))),
                "mig": _mig(d.get("mig")),
            }
        )
        for d in _list_of_objects(data.get("devices", []))
    )
    return DriverReading(**{**_typed(DriverReading, data), "devices": devices})


def _mig(raw: Any) -> MigInfo | None:
    """A MIG instance's place (a recording before MIG support has none)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise TypeError("DeviceReading.mig has the wrong type")
    return MigInfo(**_typed(MigInfo, raw))


def decode_processes(rows: list[dict[str, Any]], *, inert: bool = False) -> dict[int, ProcessInfo]:
    out = {}
    for info in _list(ProcessInfo, rows if inert else clean_value(rows)):
        out[info.pid] = info
    return out


def _list_of_objects(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not all(isinstance(item, dict) for item in raw):
        raise TypeError("expected a list of objects")
    return raw


def _list(cls: type[Any], raw: Any) -> list[Any]:
    return [cls(**_typed(cls, item)) for item in _list_of_objects(raw)]


def _typed(cls: type[Any], raw: dict[str, Any]) -> dict[str, Any]:
    """The fields of `cls` in `raw`, each checked against its annotation (nested dataclasses,
    `processes` and `devices`, are left to the caller)."""
    checks = _CHECKS[cls]
    out = {}
    for name, value in raw.items():
        fits = checks.get(name)
        if fits is None:
            continue
        if not fits(value):
            raise TypeError(f"{cls.__name__}.{name} has the wrong type")
        out[name] = tuple(value) if isinstance(value, list) else value
    return out


def _check(hint: Any) -> Callable[[Any], bool]:
    """Whether a value has the type `hint` names, as a function made once per field: asking
    typing.get_origin and get_args of every field of every line was most of the time of
    reading a record file's driver readings and process lists."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        alternatives = tuple(_check(arg) for arg in args)
        return lambda value: any(fits(value) for fits in alternatives)
    if hint is type(None):
        return lambda value: value is None
    if origin is tuple:
        item = _check(args[0])
        return lambda value: isinstance(value, list) and all(map(item, value))
    if hint is bool:
        return lambda value: isinstance(value, bool)
    if hint is int:
        return lambda value: isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return lambda value: (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        )
    if hint is str:
        return lambda value: isinstance(value, str)
    if origin is collections.abc.Mapping:  # a few named strings (a server's environment)
        key, item = _check(args[0]), _check(args[1])
        return lambda value: (
            isinstance(value, dict) and all(key(k) and item(v) for k, v in value.items())
        )
    return lambda value: False


# Per record type, a check per field; the nested records are the caller's.
_CHECKS: dict[type[Any], dict[str, Callable[[Any], bool]]] = {
    cls: {
        name: _check(hint)
        for name, hint in typing.get_type_hints(cls).items()
        if name not in ("processes", "devices", "mig")
    }
    for cls in (DeviceReading, GpuProcess, DriverReading, ProcessInfo, MigInfo)
}
