"""Reading files and replies that someone else wrote: bounded in size, type, depth and range.

memtop reads JSON that it did not write itself, often as root: OOM reports (written by a
trainer), recordings (a file someone hands you), fleet replies (whatever answers at a URL), and
its own TOML config (wherever MEMTOP_CONFIG points).  Each reader here refuses, with one
`UntrustedInput` whose message is one line:

- anything but a regular file (a FIFO hangs `open()` and `read()`, `/dev/zero` never ends), checked
  on the opened descriptor (opened non-blocking, so a FIFO cannot hang the open itself);
- more bytes than the caller's cap (read at most cap + 1 bytes, whatever the file claims);
- nesting deeper than MAX_DEPTH levels, found by scanning the bytes before any parser sees them
  (json and tomllib recurse once per level: `[` x 200k was a RecursionError traceback);
- in TOML, a dotted key of more than MAX_DEPTH parts (tomllib takes time quadratic in them:
  `a.a.a...` 30 000 deep, 60 KB, took 31 s);
- in JSON, a number beyond +-2^64 or not finite (10^400, 1e400, Infinity, NaN): past that a
  float() or int() of it raised OverflowError somewhere far from the file.

Nothing here imports the rest of memtop: the agent, the viewer's sources and the UI's config
loader all use it.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import IO, Any

import tomllib

MAX_DEPTH = 64  # no file memtop reads nests deeper than a dozen levels
MAX_NUMBER = 1 << 64  # a u64 counter is the largest number any of them holds


class UntrustedInput(Exception):
    """Input refused: the message is one line, without the file's name (the caller adds it)."""


# ------------------------------------------------------------------------------ files


def open_regular(path: Path | str, *, follow_symlinks: bool = True) -> IO[bytes]:
    """`path` opened for reading, if it is a regular file (else UntrustedInput).

    Opened with O_NONBLOCK, so that opening a FIFO with no writer returns at once instead of
    hanging; the type is then checked on the descriptor itself (no race with a rename).  A file
    that cannot be opened raises the OSError, for the caller to word (a missing config file is
    no problem at all, a missing report is)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow_symlinks else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UntrustedInput(f"is not a regular file ({_kind(mode)})")
        os.set_blocking(fd, True)  # a regular file never blocks; reads below are plain
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a file"


def read_regular(path: Path | str, max_bytes: int, *, follow_symlinks: bool = True) -> bytes:
    """The whole of a regular file of at most `max_bytes` bytes (else UntrustedInput; OSError
    when it cannot be opened or read)."""
    with open_regular(path, follow_symlinks=follow_symlinks) as handle:
        data = handle.read(max_bytes + 1)  # never more, whatever fstat said a moment ago
    if len(data) > max_bytes:
        raise UntrustedInput(f"is larger than {_size(max_bytes)}")
    return data


def _size(count: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale and count % scale == 0:
            return f"{count // scale} {unit}"
    return f"{count} bytes"


# ------------------------------------------------------------------------------ nesting

# What cannot hold structure, skipped before brackets are counted: JSON and TOML strings
# (basic, literal and both multi-line kinds) and TOML comments.  Every alternative matches
# wherever it starts (a closing quote is optional), so a hostile unterminated string costs one
# pass, never a retry from each later quote.  In JSON a quote, an apostrophe or a `#` outside a
# string is a syntax error at which json stops, so reading them the TOML way never hides a
# bracket json would reach.
_NO_STRUCTURE = re.compile(
    rb'"""(?:[^"\\]|\\[\s\S]|""?(?!"))*(?:"""(?:"{0,2}))?'
    rb"|'''[\s\S]*?(?:'''|\Z)'{0,2}"
    rb'|"(?:[^"\\\n]|\\.)*"?'
    rb"|'[^'\n]*'?"
    rb"|#[^\n]*"
)
_NOT_BRACKETS = re.compile(rb"[^\[\]{}]+")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def check_depth(data: bytes | bytearray, limit: int = MAX_DEPTH) -> None:
    """UntrustedInput if JSON or TOML `data` nests deeper than `limit` levels.

    Linear and in C but for one pass over the brackets (about 40 ms for a megabyte of them);
    data with fewer than `limit` brackets in all is passed at the cost of two counts."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return
    brackets = _NOT_BRACKETS.sub(b"", _NO_STRUCTURE.sub(b"", data))
    if max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0) > limit:
        raise UntrustedInput(f"nests deeper than {limit} levels")


# ------------------------------------------------------------------------------ JSON


class OutOfRange(UntrustedInput):
    """JSON that holds a number beyond +-2^64 or not finite: a bad value, which a reader of
    many records (a recording's lines) may skip rather than refuse the whole input for."""


class _OutOfRange(ValueError):  # raised inside json's hooks, turned into OutOfRange
    pass


def _bounded_int(text: str) -> int:
    if len(text) > 21:  # 2^64 has 20 digits: refuse before int() does the work
        raise _OutOfRange(text[:24])
    value = int(text)
    if abs(value) > MAX_NUMBER:
        raise _OutOfRange(text)
    return value


def _bounded_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or abs(value) > MAX_NUMBER:
        raise _OutOfRange(text[:24])
    return value


def _no_constant(name: str) -> Any:
    raise _OutOfRange(name)


# A number that may be out of range: 20 digits in a row, or an exponent of two digits or more
# (1e400).  Only text where one of these appears pays for the per-number checks.
_MAYBE_LARGE = re.compile(rb"\d{20}|[eE]\+?\d\d")


# Made once: json.loads with any keyword builds a new decoder per call (5 us, per line of a
# recording of millions).
_DECODER = json.JSONDecoder(parse_constant=_no_constant)
_BOUNDED_DECODER = json.JSONDecoder(
    parse_int=_bounded_int, parse_float=_bounded_float, parse_constant=_no_constant
)


def loads(data: bytes | bytearray, *, max_depth: int = MAX_DEPTH) -> Any:
    """`data` parsed as JSON (UTF-8), bounded in depth and in the range of its numbers; any
    problem is one UntrustedInput (OutOfRange for a number)."""
    check_depth(data, max_depth)
    decoder = _BOUNDED_DECODER if _MAYBE_LARGE.search(data) else _DECODER
    try:
        return decoder.decode(data.decode("utf-8"))
    except _OutOfRange as exc:
        raise OutOfRange(f"holds a number out of range ({exc})") from None
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise UntrustedInput("is not JSON") from None


def load_json_file(path: Path | str, max_bytes: int, *, follow_symlinks: bool = True) -> Any:
    """A regular file of at most `max_bytes`, parsed by `loads`."""
    return loads(read_regular(path, max_bytes, follow_symlinks=follow_symlinks))


# ------------------------------------------------------------------------------ TOML

# A dotted key (`a.b.c = 1`, `[a.b.c]`) is nesting too.  Once strings and comments are gone, a
# key lies within one run of key characters, blanks and dots: a run with more than the limit's
# dots is refused (a float has one dot, and floats are parted by commas or brackets).
_KEY_RUNS = re.compile(rb"[^\w \t.-]+")


def loads_toml(data: bytes, *, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """`data` parsed as TOML, bounded in depth (arrays, inline tables, dotted keys); any
    problem is one UntrustedInput."""
    check_depth(data, max_depth)
    if data.count(b".") > max_depth:
        runs = _KEY_RUNS.split(_NO_STRUCTURE.sub(b"", data))
        if any(run.count(b".") > max_depth for run in runs):
            raise UntrustedInput(f"has a key of more than {max_depth} parts")
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise UntrustedInput("is not UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise UntrustedInput(f"is not valid TOML ({exc})") from None
    except RecursionError:  # not reached past check_depth; never a traceback either way
        raise UntrustedInput(f"nests deeper than {max_depth} levels") from None
