"""Helpers for driving the dashboard with Textual's pilot."""

from __future__ import annotations

import html
import re
import time
from collections.abc import Callable

from textual.pilot import Pilot

from memtop.ui.app import MemtopApp


async def wait_for(pilot: Pilot, predicate: Callable[[], object], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {getattr(predicate, '__name__', '')}")
        await pilot.pause(0.05)


def notifications(app: MemtopApp) -> list[str]:
    return [f"{n.title}: {n.message}" for n in app._notifications]


def screen_text(svg: str) -> str:
    """The characters of an SVG screenshot, one line per terminal row (styles dropped)."""
    rows: dict[float, list[tuple[float, str]]] = {}
    for match in re.finditer(
        r'<text class="[^"]*" x="([\d.]+)" y="([\d.]+)"[^>]*>(.*?)</text>', svg
    ):
        x, y, content = float(match.group(1)), float(match.group(2)), match.group(3)
        rows.setdefault(y, []).append((x, html.unescape(content).replace("\xa0", " ")))
    char_width = _char_width(svg)
    lines = []
    for y in sorted(rows):
        line = ""
        for x, text in sorted(rows[y]):
            column = round(x / char_width)
            line = line.ljust(column) + text
        lines.append(line.rstrip())
    return "\n".join(lines)


def _char_width(svg: str) -> float:
    # Rich places each run at x = column × char_width; the smallest positive gap between two
    # runs on the same row is a multiple of it, and 0.61 × the 20 px font is what Rich uses.
    return 12.2
