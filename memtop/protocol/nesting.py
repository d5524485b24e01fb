"""How deep a JSON text nests, found before anything is parsed (issue 27, finding 4).

A peer's frame is untrusted, and so are recordings and reports read from disk.  `json` recurses
once per level and builds every object on the way, so the depth must be known first, and
finding it must cost about what reading the bytes costs: the old check peeled one level of
brackets per regex pass, 64 passes over the frame, and held the GIL for 136 ms on one 64 KiB
request nested 32 000 deep (0.6-1.7 s for 1 MiB).

The scan here is linear, in C but for one loop over the brackets that remain, a chunk at a time:

1. escapes go first, removed left to right as JSON reads them: escaped backslashes, then escaped
   quotes; every `"` left delimits a string;
2. the text is cut down to its skeleton of quotes and brackets (+1 for `[` `{`, -1 for `]` `}`);
   two adjacent quotes go (whether they close one string and open the next or close an empty
   one, no bracket changes side), then the strings still holding brackets, with them;
3. the depth is the running sum of the steps, a chunk at a time: a frame nested deeper than the
   limit from its start is refused after one chunk.  A skeleton made mostly of innermost pairs
   (a viewer's reply: many small arrays and objects) is first peeled twice, and what is left
   summed: each peel lowers the deepest point by one at most, so unless that figure is within
   two of the limit it decides.

In text json would reject, the count may be off past the first error, but json stops there: up
to that point the text is JSON and the count is exact, so no text json would nest past the
limit gets through.
"""

from __future__ import annotations

import re
from array import array
from itertools import accumulate

# Steps summed per turn of the running count: a deep frame is refused after one chunk.
CHUNK = 1024
PEELS = 2

_OPEN, _CLOSE = b"\x01", b"\xff"  # the steps as signed bytes: +1 and -1
_SKELETON = bytes.maketrans(b"[{]}", _OPEN * 2 + _CLOSE * 2)
_NOT_SKELETON = bytes(b for b in range(256) if b not in b'[]{}"')
_STRING = re.compile(b'"[^"]*"')
_PAIR = _OPEN + _CLOSE


def nests_deeper_than(text: bytes, limit: int) -> bool:
    """True if the JSON `text` opens more than `limit` arrays/objects inside one another (strings
    do not count); never parses, never raises."""
    if text.count(b"[") + text.count(b"{") <= limit:
        return False  # every ordinary request: two counts in C, no copy
    if b"\\" in text:
        text = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    skeleton = text.translate(_SKELETON, _NOT_SKELETON).replace(b'""', b"")
    if b'"' in skeleton:
        skeleton = _STRING.sub(b"", skeleton)  # the strings that hold brackets
        unterminated = skeleton.find(b'"')
        if unterminated >= 0:  # json stops there: what follows is inside the string
            skeleton = skeleton[:unterminated]
    if skeleton.count(_OPEN) <= limit:
        return False
    if skeleton.count(_PAIR) * 4 >= len(skeleton):
        # Mostly small arrays and objects (a viewer's reply): peeled, little is left to sum.
        peeled = skeleton
        for _ in range(PEELS):
            peeled = peeled.replace(_PAIR, b"")
        if peeled.count(_OPEN) + PEELS <= limit:
            return False
        deepest = _deepest(peeled, limit)
        if deepest > limit:
            return True
        if deepest + PEELS <= limit:
            return False
    return _deepest(skeleton, limit) > limit


def _deepest(steps: bytes, limit: int) -> int:
    """The highest running sum of the +1/-1 `steps`, or the first one past `limit`."""
    signed = array("b", steps)
    depth = deepest = 0
    for start in range(0, len(signed), CHUNK):
        running = list(accumulate(signed[start : start + CHUNK], initial=depth))
        deepest = max(deepest, max(running))
        if deepest > limit:
            return deepest
        depth = running[-1]
    return deepest
