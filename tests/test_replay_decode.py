"""What replay reads, read faster, must be what it read before:

- memtop.base.untrusted.loads parses integers with json's own parser where none can be out of
  range (a Python hook per number was a third of replay's decoding): its answers must be
  exactly those of the decoder that checks every number (`_DECODER`, swapped in as the
  reference);
- replay cleans no string of a line whose bytes say every string is clean already
  (text.inert_json, as the live client does per frame): the reference walks every line;
- a record file's fields are type-checked by a function made once per field
  (recording._CHECKS): the reference asks typing of the hint at every value, as before.

Compared: the value of every line (types too: 1 is not 1.0), or the error's class and message;
and for whole recordings, what `load` finds (span, kind, driver flag, notes, the pid clashes of
a folder) and every event of the stream, with the skipped lines.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import gzip
import json
import math
import random
import shutil
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from test_viewer_inputs import hello_result, sample_result

from memtop.base import untrusted
from memtop.model import DeviceReading, DriverReading
from memtop.sources import recording as recording_module
from memtop.sources.processes import ProcessInfo
from memtop.sources.recording import RecordError
from memtop.sources.replay import Recording, load

TRACES = Path(__file__).parent / "data" / "traces"
SHARED_TRACES = Path("/work/shared/traces/cuda-h100")
T0 = 1_700_000_000.0
HEADER = b'{"memtop_record": 1, "version": "x", "host": "h", "started": 1700000000}\n'


def _reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every number through the hooks, every line's strings walked: as before."""
    monkeypatch.setattr(untrusted, "_SHORT_INT_DECODER", untrusted._DECODER)
    monkeypatch.setattr(recording_module, "inert_json", lambda body: False)


def _outcome(data: bytes) -> tuple[str, str]:
    try:
        return ("value", repr(untrusted.loads(data)))  # repr: 1 and 1.0 differ
    except untrusted.UntrustedInput as exc:
        return (type(exc).__name__, str(exc))


def _both(data: list[bytes], monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], list[Any]]:
    fast = [_outcome(d) for d in data]
    with monkeypatch.context() as patch:
        _reference(patch)
        reference = [_outcome(d) for d in data]
    return fast, reference


def _recordings() -> list[Path]:
    """tests/data/traces, and those of shared/traces that are not copies of them."""
    ours = sorted(TRACES.glob("*.jsonl.gz"))
    copies = {path.read_bytes() for path in ours}
    shared = sorted(SHARED_TRACES.glob("*.jsonl.gz")) if SHARED_TRACES.is_dir() else []
    return ours + [path for path in shared if path.read_bytes() not in copies]


def _recording_lines() -> list[bytes]:
    return [
        line for path in _recordings() for line in gzip.decompress(path.read_bytes()).splitlines()
    ]


# Numbers on either side of 2^64 and of 20 digits, in every place a number can stand, and the
# strings that hold digits or look like numbers: `t` nested or repeated, keys in any order.
BIG = 1 << 64
ODD_LINES = [
    *(f'{{"t": {n}}}'.encode() for n in (BIG, BIG + 1, -BIG, -BIG - 1, 10**19, 10**20)),
    *(f'{{"t": {n}}}'.encode() for n in (10**19 - 1, -(10**19 - 1), 99999999999999999999)),
    b'{"t": ' + b"9" * 400 + b"}",
    b'{"t": ' + b"1" * 5000 + b"}",  # past int()'s 4300 digits: out of range, not "not JSON"
    b'{"t": 00}',
    b'{"t": 012345678901234567890}',
    b'{"t": 1e19, "u": 1.8446744073709552e19, "v": 18446744073709551616.0}',
    b'{"t": 1e400}',
    b'{"t": -1e400}',
    b'{"t": 1e-400, "u": -0, "v": 0.0, "w": 1E5, "x": 1e+5}',
    b'{"t": 123456789012345678901e-10}',
    b'{"t": NaN}',
    b'{"t": Infinity}',
    b'{"t": -Infinity}',
    b'{"t": 1, "cmd": "sample", "reply": {"result": {"n": [1, 2, 18446744073709551617]}}}',
    b'{"t": 1, "reply": {"result": {"t": 184467440737095516170}}, "t": 2}',
    b'{"cmd": "x", "t": 1.5, "src": "agent", "pid": 7, "state": "exited"}',
    b'{"t": 1, "s": "12345678901234567890123"}',  # 20 digits in a string: still in range
    b'{"t": 1, "s": "\\"18446744073709551617\\"", "u": "\\u0031\\u0032"}',
    b'{"t": 1, "s": "a \\" 99999999999999999999 \\" b", "n": 99999999999999999999}',
    b'{"t": 1, "\\u0074": 2, "k": "\\ud800", "e": "\\u00e9\xc3\xa9"}',
    b'{"t": 1, "s": "\xff"}',
    b'{"t": 1, "n": [1,]}',
    b'{"t": 1',
    b'{"t": 1}  {"t": 2}',
    b'[{"t": 1}]',
    b'"18446744073709551617"',
    b"18446744073709551617",
    b"1e400",
    b'{"t": ' + b"[" * 70 + b"]" * 70 + b"}",
    b'{"t": 1, "deep": ' + b"[" * 30 + b"18446744073709551617" + b"]" * 30 + b"}",
    b"",
    b"   ",
]


def test_loads_answers_as_the_checking_decoder_on_odd_lines(monkeypatch: pytest.MonkeyPatch):
    fast, reference = _both(ODD_LINES, monkeypatch)
    assert fast == reference
    # The lines are odd enough: both kinds of answer, and the range check at work.
    kinds = {kind for kind, _ in reference}
    assert {"value", "OutOfRange", "UntrustedInput"} <= kinds


def test_loads_answers_as_the_checking_decoder_on_mutated_recording_lines(
    monkeypatch: pytest.MonkeyPatch,
):
    # Real lines with digit runs of 18 to 22 digits put in anywhere (in strings, in numbers,
    # between tokens), or cut anywhere: 400 lines, seeded.
    rng = random.Random(20)
    lines = [line for line in _recording_lines()[:60] if line.strip()]
    mutated = []
    for n in range(400):
        line = rng.choice(lines)
        at = rng.randrange(len(line))
        if n % 4 == 0:
            mutated.append(line[:at])
        else:
            size = rng.randint(18, 22)
            digits = str(rng.randrange(10 ** (size - 1), 10**size))
            mutated.append(line[:at] + digits.encode() + line[at:])
    fast, reference = _both(mutated, monkeypatch)
    assert fast == reference
    assert sum(kind == "OutOfRange" for kind, _ in reference) > 10


def test_loads_answers_as_the_checking_decoder_on_every_recorded_line(
    monkeypatch: pytest.MonkeyPatch,
):
    lines = _recording_lines()
    fast, reference = _both(lines, monkeypatch)
    assert fast == reference
    assert len(lines) > 1800


def _seen(recording: Recording) -> dict[str, Any]:
    """What replay shows of a recording: load's findings, then the stream's events and skips."""
    return {
        "kind": recording.kind,
        "span": (recording.start, recording.end),
        "has_devices": recording.has_devices,
        "header": recording.header,
        "notes": recording.notes,
        "scans": recording._scans,
        "events": [repr(event) for event in recording.stream()],
        "skipped": (recording.skipped_count, recording.skipped),
    }


def _both_loads(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    def seen() -> Any:
        try:
            return _seen(load(path))
        except RecordError as exc:
            return str(exc)

    fast = seen()
    with monkeypatch.context() as patch:
        _reference(patch)
        reference = seen()
    return fast, reference


def _odd_record(path: Path) -> None:
    reply = {"result": hello_result(7)}
    hello = {"t": T0, "src": "agent", "pid": 7, "cmd": "hello", "reply": reply}
    lines: list[bytes] = [HEADER, json.dumps(hello).encode()]
    for n in range(1, 8):
        sample = sample_result(T0 + n)
        line = {"t": T0 + n, "src": "agent", "pid": 7, "cmd": "sample", "reply": {"result": sample}}
        lines.append(json.dumps(line).encode())
    # Strings to clean (a control, a bidi override, a line break, not ASCII) and clean ones,
    # in every kind of line.
    for n, name in enumerate(["H100", "H100\x1b[2J", "caf\u00e9 \u202e"]):
        device = DeviceReading(0, "GPU-a", name, 80 << 30, 2 << 30)
        reading = {
            "t": T0 + n,
            "src": "nvml",
            "reading": dataclasses.asdict(DriverReading(True, (device,))),
        }
        info = ProcessInfo(7, 1000, "me", ("train.py", name), name, T0)
        rows = {"t": T0 + n, "src": "processes", "processes": [dataclasses.asdict(info)]}
        sample = sample_result(T0 + n)
        sample["devices"][0]["name"] = name  # type: ignore[index]
        line = {"t": T0 + n, "src": "agent", "pid": 7, "cmd": "sample", "reply": {"result": sample}}
        lines += [
            json.dumps(reading).encode(),
            json.dumps(rows).encode(),
            json.dumps(line).encode(),
        ]
        lines.append(json.dumps(line, ensure_ascii=False).encode())
    # The earliest and latest times on lines that are skipped: they must not widen the span.
    lines += [
        b'{"t": 1600000000, "src": "agent", "pid": 7, "state": "exited", "n": 18446744073709551617}',  # noqa: E501
        b'{"src": "agent", "pid": 7, "state": "exited", "t": 1800000000, "e": -1e400}',
        b'{"t": 1700000100, "src": "agent", "pid": 8, "state": "exited", "x": "99999999999999999999"}',  # noqa: E501
        b'{"pid": 9, "state": "exited", "src": "agent", "t": 1700000200.5, "t2": {"t": 1}}',
        b'{"t": 1700000300, "src": "agent", "pid": 18446744073709551616, "state": "exited"}',
        b'{"t": 18446744073709551616, "src": "agent", "pid": 9, "state": "exited"}',
        b'{"t": 1700000400, "src": "agent", "pid": 9, "state": "exited", "error": "\\u00e9\\""}',
    ]
    path.write_bytes(gzip.compress(b"\n".join(lines) + b"\n"))


def test_recordings_load_and_play_as_with_the_checking_decoder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    odd = tmp_path / "odd"
    odd.mkdir()
    _odd_record(odd / "a.memtop")
    shutil.copy(odd / "a.memtop", odd / "b.memtop")  # a folder whose pids clash
    cut = tmp_path / "cut.jsonl.gz"  # no gzip trailer, the last line half-written
    cut.write_bytes(gzip.compress(gzip.decompress((TRACES / "oom.jsonl.gz").read_bytes())[:-900]))
    broken = tmp_path / "broken.memtop"  # a line that is not JSON in the middle: refused
    broken.write_bytes(HEADER + b'{"t": 1, "src": [}\n{"t": 1}\n')
    shared = [path for path in _recordings() if path.parent != TRACES]
    for path in (TRACES, *shared, odd, odd / "a.memtop", cut, broken):
        fast, reference = _both_loads(path, monkeypatch)
        assert fast == reference, path
    fast, _ = _both_loads(odd, monkeypatch)
    assert fast["span"] == (T0, 1_700_000_400.0)
    assert fast["skipped"][0] == 6  # in each file: 2 out of range, 1 past the year 9999
    assert [scan.clash for scan in fast["scans"]] == [frozenset(), {7, 8, 9, BIG}]
    events = "\n".join(fast["events"])  # cleaned in all three kinds of line; clean ones kept
    assert "H100?[2J" in events and "caf\u00e9 ?" in events and "'H100'" in events
    assert "\\x1b" not in events and "\\u202e" not in events  # (as repr writes them)
    assert _both_loads(broken, monkeypatch)[0] == f"{broken}: line 2 is not JSON"


def _fits_as_before(value: Any, hint: Any) -> bool:
    """recording._typed's check as it was, asking typing of the hint at every value."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits_as_before(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if origin is tuple:
        return isinstance(value, list) and all(_fits_as_before(v, args[0]) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        )
    if hint is str:
        return isinstance(value, str)
    if origin is collections.abc.Mapping:
        return isinstance(value, dict) and all(
            _fits_as_before(k, args[0]) and _fits_as_before(v, args[1]) for k, v in value.items()
        )
    return False


def test_the_field_checks_made_once_answer_as_the_checks_asked_each_time():
    # Every field of the record types a record file's lines are decoded into, against values
    # of every JSON shape (and the ones that sit at a type's edge: bool is an int, inf a float).
    scalars = [
        0,
        7,
        -1,
        2**70,
        True,
        False,
        1.5,
        -0.0,
        math.inf,
        -math.inf,
        math.nan,
        "",
        "x",
        None,
    ]
    values = [
        *scalars,
        *([s] for s in scalars),
        [1, "a"],
        [1, 2.5],
        ["a", "b"],
        [[1]],
        [None],
        {},
        {"a": "b"},
        {"a": 1},
        {"a": None},
        {1: "a"},
        {"a": "b", "c": ["d"]},
    ]
    checked = 0
    for cls, checks in recording_module._CHECKS.items():
        hints = typing.get_type_hints(cls)
        for name, fits in checks.items():
            for value in values:
                assert fits(value) is _fits_as_before(value, hints[name]), (cls, name, value)
                checked += 1
    assert checked > 1000
