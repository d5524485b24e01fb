"""Reading files and replies that someone else wrote: bounded in size, type, depth and range.

memtop reads JSON that it did not write itself, often as root: OOM reports (written by a
trainer), recordings (a file someone hands you), fleet replies (whatever answers at a URL), and
its own TOML config (wherever MEMTOP_CONFIG points).  Each reader here refuses, with one
`UntrustedInput` whose message is one line:

- anything but a regular file (a FIFO hangs `open()` and `read()`, `/dev/zero` never ends), found
  before the file is opened for reading (see open_regular);
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

MAX_DEPTH = 64  # no file memtop reads nests deeper than a dozen levels
MAX_NUMBER = 1 << 64  # a u64 counter is the largest number any of them holds


class UntrustedInput(Exception):
    """Input refused: the message is one line, without the file's name (the caller adds it)."""


# ------------------------------------------------------------------------------ files


def open_regular(path: Path | str, *, follow_symlinks: bool = True) -> IO[bytes]:
    """`path` opened for reading, if it is a regular file (else UntrustedInput).

    The path is opened with O_PATH first, which opens nothing: no FIFO waits for a writer and
    no device's driver runs its open() (as root, opening /dev/watchdog starts the watchdog).
    The type is checked on that descriptor, and only a regular file is then opened for reading,
    through /proc/self/fd: the very file checked, whatever the path has become since.  Without
    `follow_symlinks` a symlink is refused as such.  A path that cannot be opened raises the
    OSError, for the caller to word (a missing config file is no problem at all, a missing
    report is)."""
    flags = os.O_PATH | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    handle = os.open(path, flags)
    try:
        mode = os.fstat(handle).st_mode
        if not stat.S_ISREG(mode):
            raise UntrustedInput(f"is not a regular file ({_kind(mode)})")
        fd = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(handle)
    return os.fdopen(fd, "rb")


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
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

_ESCAPE = re.compile(rb"\\[\s\S]")
_NOT_QUOTE_OR_BRACKET = bytes(b for b in range(256) if b not in b'"[]{}')
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def check_depth(data: bytes | bytearray, limit: int = MAX_DEPTH) -> None:
    """UntrustedInput if JSON `data` nests deeper than `limit` levels (brackets in strings
    are text, not nesting).

    Without a regex match per string (a 15 MB fleet reply holds 1.6 M of them: 8 s and 230 MB
    that way): escapes go first (`\\"` is no quote), then everything but quotes and brackets,
    then every `""` (a string with no bracket in it, or two quotes with nothing between:
    dropping a pair keeps every later quote's parity), and what is left between the remaining
    quotes is inside strings.  About 20 ms a megabyte, all in C but a pass over the brackets;
    data with fewer than `limit` brackets in all costs two counts.  An unterminated string, a
    backslash outside one: JSON stops there, before any bracket this reading might miss."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return
    if b"\\" in data:
        data = _ESCAPE.sub(b"", data)
    compact = data.translate(None, _NOT_QUOTE_OR_BRACKET).replace(b'""', b"")
    _check_brackets(b"".join(compact.split(b'"')[0::2]), limit)


def _check_brackets(brackets: bytes, limit: int) -> None:
    """`brackets` holds only brackets: UntrustedInput if they nest deeper than `limit`."""
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


# Made once: json.loads with any keyword builds a new decoder per call (5 us, per line of a
# recording of millions).  A hook is a Python call per number: a sample reply holds ~125
# integers, and parse_int was a third of the time of parsing one (a regex that looked for long
# numbers first cost more than that on megabytes).  So integers are left to json's own parser
# where none can be out of range, known by one C pass over the bytes: an integer beyond 2^64
# has 20 digits or more, and data without 20 digits in a row (in strings or not) has none.
# Data with such a run, a long number or a long string of digits, goes through the hook.
# Floats (a few a reply) and NaN / Infinity keep theirs: a float's range needs its exponent.
_DECODER = json.JSONDecoder(
    parse_int=_bounded_int, parse_float=_bounded_float, parse_constant=_no_constant
)
_SHORT_INT_DECODER = json.JSONDecoder(parse_float=_bounded_float, parse_constant=_no_constant)
_DIGITS_AS_ZERO = bytes(ord("0") if 0x30 <= b <= 0x39 else ord(" ") for b in range(256))
_UNBOUNDED_INT = b"0" * len(str(MAX_NUMBER))  # 20 digits: 2^64 itself, and every int above


def loads(data: bytes | bytearray, *, max_depth: int = MAX_DEPTH) -> Any:
    """`data` parsed as JSON (UTF-8), bounded in depth and in the range of its numbers; any
    problem is one UntrustedInput (OutOfRange for a number)."""
    check_depth(data, max_depth)
    long_digits = _UNBOUNDED_INT in data.translate(_DIGITS_AS_ZERO)
    decoder = _DECODER if long_digits else _SHORT_INT_DECODER
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

# What cannot hold structure in TOML: strings (basic, literal, both multi-line kinds) and
# comments.  Every alternative matches wherever it starts (a closing quote is optional), so a
# hostile unterminated string costs one pass, never a retry from each later quote.  A regex
# match per string is slow on megabytes (see check_depth), but a config is 64 KiB at most.
_TOML_NO_STRUCTURE = re.compile(
    rb'"""(?:[^"\\]|\\[\s\S]|""?(?!"))*(?:"""(?:"{0,2}))?'
    rb"|'''[\s\S]*?(?:'''|\Z)'{0,2}"
    rb'|"(?:[^"\\\n]|\\.)*"?'
    rb"|'[^'\n]*'?"
    rb"|#[^\n]*"
)
_NOT_BRACKETS = re.compile(rb"[^\[\]{}]+")
# A dotted key (`a.b.c = 1`, `[a.b.c]`) is nesting too.  Once strings and comments are gone, a
# key lies within one run of key characters, blanks and dots: a run with more than the limit's
# dots is refused (a float has one dot, and floats are parted by commas or brackets).
_KEY_RUNS = re.compile(rb"[^\w \t.-]+")


def loads_toml(data: bytes, *, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """`data` parsed as TOML, bounded in depth (arrays, inline tables, dotted keys); any
    problem is one UntrustedInput."""
    if data.count(b"[") + data.count(b"{") + data.count(b".") > max_depth:
        structure = _TOML_NO_STRUCTURE.sub(b"", data)
        _check_brackets(_NOT_BRACKETS.sub(b"", structure), max_depth)
        if any(run.count(b".") > max_depth for run in _KEY_RUNS.split(structure)):
            raise UntrustedInput(f"has a key of more than {max_depth} parts")
    # Imported here: the dashboard reads a TOML file only where the user wrote a config (~0.7 MB
    # and a few ms of its start otherwise).
    import tomllib

    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise UntrustedInput("is not UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise UntrustedInput(f"is not valid TOML ({exc})") from None
    except RecursionError:  # not reached past check_depth; never a traceback either way
        raise UntrustedInput(f"nests deeper than {max_depth} levels") from None


# ------------------------------------------------------------------------------ code as root


def root_may_not_load(path: Path | str) -> str | None:
    """Why root must not import or load code from `path` (a folder on an import path, a shared
    library), or None when only root can change what it holds: the path (symlinks resolved)
    and every folder above it belong to root and no one else may write them.  A folder above
    may be writable by all when it is sticky (/tmp): no one else can rename or remove what root
    made in it; the path itself may not (anyone could add a module to it).  Group write counts
    as write by others unless the group is root's.  A path that does not exist is refused too
    (someone could make it)."""
    resolved = os.path.realpath(path)
    current = resolved
    while True:
        try:
            info = os.lstat(current)
        except OSError as exc:
            return f"{current} cannot be checked ({exc.strerror or exc})"
        if info.st_uid != 0:
            return f"{current} belongs to uid {info.st_uid}, not root"
        others = info.st_mode & stat.S_IWOTH or (info.st_mode & stat.S_IWGRP and info.st_gid != 0)
        if others and (current == resolved or not info.st_mode & stat.S_ISVTX):
            return f"{current} may be written by users other than root"
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent
