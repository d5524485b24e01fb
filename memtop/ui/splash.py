"""The dashboard's first paint, before Textual is imported.

Importing Textual and memtop's panels takes ~0.25 s of CPU before Textual can draw anything; on
a loaded box or a slow SSH link that is a blank terminal for half a second. So the command line
switches to the alternate screen and writes the header row itself — the same " memtop  host"
Textual draws a moment later, with "starting…" where the source will be — with one os.write and
nothing imported. Textual then takes the same alternate screen over and repaints everything.

`restore()` undoes it when Textual never got as far as starting (an error or Ctrl-C while
importing); once Textual ran it has left the alternate screen itself, and restore is a no-op.
"""

from __future__ import annotations

import contextlib
import os

ENTER = "\x1b[?1049h\x1b[?25l\x1b[H\x1b[2J"  # alternate screen, cursor hidden, cleared
# Only leave and show the cursor: after Textual has left already, this changes nothing (no clear,
# which would wipe the user's own screen).
LEAVE = "\x1b[?1049l\x1b[?25h"


def header_line(host: str, width: int, colour: bool) -> str:
    """The header row as Textual will draw it (memtop.ui.app.MemtopApp._header)."""
    host = "".join(ch if ch.isprintable() else "?" for ch in host)[: max(0, width - 24)]
    if not colour:
        return f"\x1b[7m memtop \x1b[0m \x1b[1m{host}\x1b[0m  starting…"
    return f"\x1b[1;30;46m memtop \x1b[0m \x1b[1;97m{host}\x1b[0m  \x1b[90mstarting…\x1b[0m"


def paint(fd: int, colour: bool = True) -> bool:
    """Write the first frame to `fd` if it is a terminal that understands escapes; returns
    whether anything was written (and so whether `restore` has anything to undo)."""
    term = os.environ.get("TERM", "")
    if not os.isatty(fd) or term in ("", "dumb") or os.environ.get("MEMTOP_NO_SPLASH"):
        return False
    try:
        width = os.get_terminal_size(fd).columns
    except OSError:
        width = 80
    colour = colour and "NO_COLOR" not in os.environ
    global _shown
    # Noted before the write: a Ctrl-C that lands as the write returns must still be undone.
    _shown = True
    try:
        os.write(fd, (ENTER + header_line(os.uname().nodename, width, colour)).encode())
    except OSError:
        _shown = False
        return False
    return True


_shown = False  # the alternate screen was entered here and not left yet


def restore(fd: int) -> None:
    """Leave the alternate screen if `paint` entered it (a no-op otherwise, and the second
    time): callers run it in a `finally` whether or not the paint happened."""
    global _shown
    if not _shown:
        return
    _shown = False
    with contextlib.suppress(OSError):
        os.write(fd, LEAVE.encode())
