"""The depth of an untrusted frame, found by a linear scan before json builds anything (issue 27,
finding 4): exact on every JSON text, refused within one chunk when deep, never fooled by
brackets, quotes or backslashes inside strings."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memtop import protocol
from memtop.protocol import nesting

MiB = 1 << 20

# Strings made of what could fool a scanner: brackets, quotes, backslashes, escapes, non-ASCII.
tricky_text = st.text(
    alphabet=st.sampled_from(list('[]{}"\\,:/ abu0é€\U0001f600\n\t')), max_size=12
)
numbers = st.integers() | st.floats(allow_nan=False, allow_infinity=False)
json_values = st.recursive(
    st.none() | st.booleans() | numbers | tricky_text,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(tricky_text, children, max_size=3)
    ),
    max_leaves=40,
)


def depth_of(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    return 0


def first_past(text: str, limit: int) -> int | None:
    """Where valid JSON `text` first nests past `limit` (a plain per-character reading)."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return i
        elif ch in "]}":
            depth -= 1
    return None


@pytest.mark.slow
@settings(max_examples=600, deadline=None)
@given(value=json_values, limit=st.integers(0, 6), ascii_only=st.booleans())
def test_the_scan_finds_the_depth_of_any_json_exactly(value, limit, ascii_only):
    text = json.dumps({"v": value}, ensure_ascii=ascii_only).encode()
    assert nesting.nests_deeper_than(text, limit) == (1 + depth_of(value) > limit)


@settings(max_examples=400, deadline=None)
@given(
    value=json_values,
    limit=st.integers(0, 5),
    cut=st.integers(0, 200),
    garbage=st.text(alphabet='[]{}"\\x,', max_size=30),
)
@pytest.mark.slow
def test_text_that_goes_bad_after_nesting_too_deep_is_still_refused(value, limit, cut, garbage):
    # json reads a text up to its first error: whatever follows the point where it went past
    # the limit, the scan must refuse it.
    text = json.dumps({"v": value})
    past = first_past(text, limit)
    if past is None:
        return
    bad = text[: past + 1 + cut] + garbage
    assert nesting.nests_deeper_than(bad.encode(), limit)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(args=st.dictionaries(tricky_text, json_values, max_size=4), request_id=st.integers())
def test_every_shallow_request_is_read(args, request_id):
    message = {"id": request_id, "cmd": "sample", "args": args}
    body = json.dumps(message).encode()
    assert protocol.decode_body(body) == message


@pytest.mark.parametrize(
    "value",
    [
        {"s": "[" * 5000, "t": "]" * 5000 + '"\\'},
        {"s": '\\"[[[[' * 1000},
        {"s": "\\" * 999 + '"[{'},
        {"a": [[[1]]] * 5000, "b": ['[{\\"', "]}"] * 300},
        {"deep_as_allowed": json.loads("[" * 63 + "]" * 63)},
    ],
)
def test_brackets_quotes_and_escapes_in_strings_do_not_count(value):
    body = json.dumps(value).encode()
    assert not nesting.nests_deeper_than(body, protocol.MAX_DEPTH)
    assert protocol.decode_body(body) == value


def deep_frames() -> Iterator[tuple[str, bytes]]:
    head, tail = b'{"id":1,"cmd":"sample","args":', b"}"
    depth = (MiB - len(head) - len(tail)) // 2
    yield "balanced", head + b"[" * depth + b"]" * depth + tail
    yield "objects", b'{"a":' * (MiB // 5)
    yield "mixed", b'[{"a":' * (MiB // 6)
    yield "after strings", b'{"s":"' + b"x" * (MiB // 2) + b'","a":' + b"[" * (MiB // 3)


class CountingAccumulate:
    """itertools.accumulate that counts the steps it is handed: the scan's only Python-level
    work grows with this count, everything else is a pass of a C routine over the bytes."""

    def __init__(self) -> None:
        self.steps = 0

    def __call__(self, steps: Iterable[int], initial: int = 0) -> Iterator[int]:
        items = list(steps)
        self.steps += len(items)
        total = initial
        yield total
        for step in items:
            total += step
            yield total


@pytest.mark.parametrize(("shape", "body"), list(deep_frames()), ids=lambda x: str(x)[:14])
def test_a_deep_mebibyte_is_refused_after_one_chunk_and_json_never_sees_it(
    monkeypatch, shape, body
):
    counting = CountingAccumulate()
    monkeypatch.setattr(nesting, "accumulate", counting)

    def no_json(*args: object, **kwargs: object) -> None:
        raise AssertionError("json.loads ran on a frame the scan should have refused")

    monkeypatch.setattr(protocol.framing.json, "loads", no_json)
    with pytest.raises(protocol.ProtocolError, match="deeper than 64"):
        protocol.decode_body(body)
    assert counting.steps <= nesting.CHUNK, shape


@pytest.mark.parametrize(
    "body",
    [
        b'"' + b'\\"' * (MiB // 2),  # an unterminated string of escaped quotes
        b'"' * MiB,
        b"\\" * MiB,
        b'["' + b"[" * (MiB - 2),  # every bracket inside one unterminated string
        b"[]" * (MiB // 2),
    ],
    ids=["escaped-quotes", "quotes", "backslashes", "unterminated", "pairs"],
)
def test_strings_and_pairs_cost_no_per_byte_loop(monkeypatch, body):
    # Shapes that made a regex backtrack or a peeler loop: no step is summed in Python at all.
    counting = CountingAccumulate()
    monkeypatch.setattr(nesting, "accumulate", counting)
    assert not nesting.nests_deeper_than(body, protocol.MAX_DEPTH)
    assert counting.steps == 0


def test_the_decoder_says_what_a_begun_frame_lacks_so_a_reader_takes_it_in_one_read():
    frame = protocol.encode_frame({"pad": "x" * 60_000})
    decoder = protocol.FrameDecoder(max_frame=64 << 10)
    assert decoder.missing_bytes == 0
    assert list(decoder.feed(frame[:4096])) == []
    assert decoder.missing_bytes == len(frame) - 4096
    assert [m["pad"][:1] for m in decoder.feed(frame[4096:])] == ["x"]
    assert decoder.missing_bytes == 0
