"""Text from a peer made inert, and the small parsers of numbers and addresses that go with it.

Every string memtop takes from an agent, a recording, an OOM report, the driver or another
process's command line passes through clean_text (or clean_value) once, where it enters.  The
device sources (NVML, amdsmi, processes, Prometheus) import this module, not the socket protocol:
it needs nothing but `re`.
"""

from __future__ import annotations

import re
from typing import Any

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
    if len(text) <= limit and text.isprintable():
        # Already clean: every character _CONTROL or _SURROGATE matches is one str.isprintable()
        # refuses (Cc, Cf, Zl, Zp, Cs), so the C check spares the two regexes and the copy for
        # nearly every string an agent sends (key names, GPU names), every agent every second.
        return text
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return _SURROGATE.sub(_escape_surrogate, _CONTROL.sub("?", text))


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
_PRINTABLE_ASCII = bytes(range(0x20, 0x7F))
# A JSON escape: \uXXXX, or a backslash and the character it escapes (\" \\ \/ \b \f \n \r \t).
_JSON_ESCAPE = re.compile(rb"\\(?:u([0-9a-fA-F]{4})|(.))", re.DOTALL)
_PLAIN_ESCAPES = frozenset(b'"\\/')  # the escapes that spell printable ASCII


def inert_json(body: bytes) -> bool:
    """Whether every string the JSON text `body` holds is clean as it is (clean_value would
    return its object unchanged): printable ASCII bytes only, every escape one of a printable
    character (\\", \\\\, \\/, or \\uXXXX of a character str.isprintable() takes, which is
    clean_text's test: `→` in an OOM report's advice; not \\n, not a bidi override, not a
    surrogate), and no string longer than MAX_TEXT.  A steady `sample` is 2-3 KB of such bytes:
    checked in C here (and the escapes, where there are some, one by one), its ~70 strings need
    no walk.  An OOM-ed trainer's every sample carried an escaped `→` and was walked whole, every
    second, as was any reply past MAX_TEXT bytes (an agent with several GPUs)."""
    if body.translate(None, _PRINTABLE_ASCII):
        return False  # a byte beyond printable ASCII: UTF-8 text, a raw control
    if b"\\" not in body:
        # No escape: every string is one run between two quotes, so none is longer than the
        # longest run.
        return len(body) <= MAX_TEXT or not _run_without_quote_past_max_text(body)
    for code, char in _JSON_ESCAPE.findall(body):
        if code:
            if not chr(int(code, 16)).isprintable():  # controls, Cf, surrogates (Cs), ...
                return False
        elif char[0] not in _PLAIN_ESCAPES:
            return False
    return len(body) <= MAX_TEXT  # (an escaped quote hides where a string ends)


_QUOTE_FREE_BLOCK = (MAX_TEXT + 1) // 2


def _run_without_quote_past_max_text(body: bytes) -> bool:
    """Whether `body` holds more than MAX_TEXT bytes in a row without a quote.  Such a run
    holds a whole block of (MAX_TEXT + 1) // 2 bytes aligned on a multiple of that size: where
    every such block holds a quote (a sample reply has one every ~20 bytes) there is none,
    known from one search per block; splitting a 5 KB reply at its ~500 quotes cost four times
    the rest of inert_json."""
    size = _QUOTE_FREE_BLOCK
    # find() within bounds: no copy of each block (this runs on every frame a live viewer reads).
    blocks = range(0, len(body) - size + 1, size)
    if all(body.find(b'"', start, start + size) >= 0 for start in blocks):
        return False
    return max(map(len, body.split(b'"'))) > MAX_TEXT


def clean_value(value: Any, depth: int = 0) -> Any:
    """A decoded reply with every string (keys included) passed through clean_text.

    Containers in which nothing needed cleaning are returned as they are, not copied: a
    viewer's first `sample` carries a thousand step marks per agent, and a second copy of them
    was most of the viewer's peak memory."""
    if type(value) in _SCALARS:
        return value  # the bulk of a reply: numbers, checked first
    if isinstance(value, str):
        return clean_text(str(value))
    if isinstance(value, dict):
        changed = False
        pairs = []
        for key, item in value.items():
            clean_key = clean_text(key)
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


def decimal(text: str) -> int | None:
    """`text` as a non-negative integer when it is ASCII digits only, else None.  str.isdigit
    also takes "²" (which int() refuses: a file named `².sock`, or a directory `/tmp/memtop-²`
    that anyone can make, would stop the scan) and other scripts' digits (which int() reads:
    `٠` would pass for uid 0)."""
    return int(text) if text.isascii() and text.isdigit() else None
