"""The dashboard's first paint, before Textual is imported.

Importing Textual and memtop's panels takes ~0.25 s of CPU before Textual can draw anything; on
a loaded box or a slow SSH link that is a blank terminal for half a second. So the command line
switches to the alternate screen and writes the header row itself — the same " memtop  host"
Textual draws a moment later, with "starting…" where the source will be — with one os.write and
nothing imported. Textual then takes the same alternate screen over and repaints everything.

`restore()` undoes it when Textual never got as far as starting (an error or Ctrl-C while
importing); once Textual ran it has left the alternate screen itself, and restore is a no-op.

The first sampling round runs meanwhile (memtop.commands.watch starts the sampler before
importing the observer and Textual).  Its driver reading comes first, before any agent answers:
`driver_lines` makes the GPUs' rows of it, painted at once.  When the round's observation lands
before Textual is ready, `paint_figures` writes every GPU's and process's figures under the
header (the view-model's rows, plainly: the same values Textual draws next).  `hand_over()`,
called just before Textual's first frame (the app's on_mount: Textual's driver has started, and
its few mode-setting writes are whole writes of their own), ends that: no write of ours can land
inside Textual's frames (Textual's first frame, on the alternate screen, covers every cell).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memtop.engine.observation import Observation
    from memtop.engine.scope import Scope
    from memtop.model import DriverReading

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
_handed_over = False  # Textual has the terminal: nothing more is written here
_lock = threading.Lock()  # a paint from the sampler's thread against the hand-over


def figure_lines(
    obs: Observation, width: int, height: int, scope: Scope | None = None
) -> list[str]:
    """The rows under the header: a line per GPU, then the process table's rows (as many as
    fit), from the view-model Textual renders (memtop.ui.view): the same figures, plain, and
    filtered by the same `scope` (--only, --user, --pid)."""
    from memtop.ui import view
    from memtop.ui.render import short_bytes

    dash = view.build(scope.apply(obs) if scope else obs)
    source = f"{dash.source}  ·  {len(dash.gpus)} GPUs  ·  {dash.agents} agents"
    lines = [source]
    for gpu in dash.gpus:
        lines.append(_gpu_line(gpu.index, gpu.host, gpu.name, gpu.used, gpu.total))
    lines.append("")
    lines.append(f"{'PID':>7} {'GPU':>3} {'USED':>6} {'ALLOC':>6} {'RSVD':>6} {'STEP':>7}  COMMAND")
    for row in dash.processes[: max(0, height - len(lines) - 3)]:
        step = "—" if row.step is None else str(row.step)
        number = "—" if row.gpu is None else str(row.gpu)
        command = f"{row.host}: {row.command}" if row.host else row.command
        lines.append(
            f"{row.pid:>7} {number:>3} {short_bytes(row.used):>6} {short_bytes(row.allocated):>6} "
            f"{short_bytes(row.reserved):>6} {step:>7}  {command}"
        )
    return [line[:width] for line in lines]


def driver_lines(reading: DriverReading, width: int, scope: Scope | None = None) -> list[str]:
    """The GPUs' rows from the driver's reading alone, the moment it is read and before any
    agent answers (the round's full figures replace them): the same rows `figure_lines` writes,
    for the same GPUs.  None where this reading's rows would not be the view's (no driver, the
    agents' own GPUs, MIG instances, another host's GPUs, a scope of MIG instances): nothing
    is painted early then, rather than rows the view would then contradict."""
    from memtop.model import SOURCE_AGENT

    if not reading.available or reading.source == SOURCE_AGENT or not reading.devices:
        return []
    if scope is not None and scope.instances is not None:
        return []
    devices = [
        d for d in reading.devices if scope is None or scope.gpus is None or d.index in scope.gpus
    ]
    if any(d.mig is not None or d.mig_mode or d.host for d in reading.devices):
        return []
    lines = [f"{len(devices)} GPUs  ·  asking the agents…"]
    lines += [_gpu_line(d.index, "", d.name, d.used_bytes, d.total_bytes) for d in devices]
    return [line[:width] for line in lines]


def _gpu_line(index: int, host: str, name: str, used: int | None, total: int | None) -> str:
    from memtop.figures.units import short_bytes

    share = f"{100 * used / total:5.1f} %" if used is not None and total else "    —"
    where = f" {host}" if host else ""
    figures = f"{short_bytes(used):>6} / {short_bytes(total):<6} {share}"
    return f"GPU {index}{where}  {name[:26]:<26} {figures}"


def paint_figures(fd: int, lines: list[str]) -> bool:
    """Write `lines` under the header painted by `paint`, unless Textual has the terminal
    already (`hand_over`); whether they were written.  Safe from any thread."""
    text = "".join(f"\x1b[{row};1H\x1b[2K" + _printable(line) for row, line in enumerate(lines, 2))
    with _lock:
        if not _shown or _handed_over:
            return False
        try:
            os.write(fd, text.encode())
        except OSError:
            return False
    return True


def _printable(line: str) -> str:
    return "".join(ch if ch.isprintable() else "?" for ch in line)


def hand_over() -> None:
    """Textual is about to take the terminal: no figures are painted from now on (a paint in
    progress finishes first)."""
    global _handed_over
    with _lock:
        _handed_over = True


def restore(fd: int) -> None:
    """Leave the alternate screen if `paint` entered it (a no-op otherwise, and the second
    time): callers run it in a `finally` whether or not the paint happened."""
    global _shown
    if not _shown:
        return
    _shown = False
    with contextlib.suppress(OSError):
        os.write(fd, LEAVE.encode())
