"""What every driver library's device source (NVML, amdsmi) shares: its text made inert and
encodable (a driver, or a stand-in library, says what it likes, and root's terminal shows it),
and the two internal failures that steer a read (one device lost, the whole library down)."""

from __future__ import annotations

from typing import Any

from memtop.protocol.text import clean_text

MAX_LINE = 200  # a status line's worth


def one_line(text: str) -> str:
    """An error's text as one status line: whitespace folded, control characters and lone
    surrogates made inert (clean_text), cut to MAX_LINE."""
    return clean_text(" ".join(text.split()), MAX_LINE)


def driver_text(value: Any) -> str:
    """A name, UUID, bus id or version from the library: old bindings return bytes (NUL
    padded), new ones str; inert either way."""
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode("utf-8", errors="replace").strip("\x00")
    return clean_text(value, 200)


class DeviceLost(Exception):
    """Internal: the device stopped answering; stop querying it until a reopen attempt."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


class DriverDown(Exception):
    """Internal: the library as a whole stopped working; re-initialise later."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line
