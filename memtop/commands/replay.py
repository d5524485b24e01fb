"""`memtop replay FILE|DIR`: a recording on the dashboard with a time cursor, or one report.

`--once [--json] [--at SECONDS]` prints the report as `memtop --once` would have printed it at
that moment of the recording (default: its end).  The report carries an extra `replay` object
(files, duration, the moment shown).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from memtop.base.errors import MemtopError

if TYPE_CHECKING:  # loaded when the command runs, not when the parser is built
    from memtop.engine.playback import Player
    from memtop.engine.store import Store
    from memtop.sources.replay import Recording


class ReplayError(MemtopError):
    """One line for the user, exit code 1."""


def add_arguments(replay: argparse.ArgumentParser) -> None:
    """`memtop replay`'s arguments (its name and help are in memtop.commands.parser)."""
    replay.add_argument("path", type=Path, metavar="FILE|DIR")
    replay.add_argument("--once", action="store_true", help="print one report and exit")
    replay.add_argument("--json", action="store_true", help="with --once: print JSON")
    replay.add_argument(
        "--at",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the moment to show, in seconds from the start (default: the end with --once)",
    )
    replay.add_argument(
        "--speed", type=float, default=1.0, help="playback speed on the dashboard (default 1)"
    )


def open_recording(path: Path) -> Recording:
    from memtop.sources.replay import load

    recording = load(path)  # a RecordError is said in one line
    if not recording.holds_events():  # read up to the first event, not all of them
        raise ReplayError(f"{path}: the recording holds nothing to replay")
    return recording


def moment(recording: Recording, at: float | None, default_end: bool) -> float:
    """Unix time of `--at SECONDS` (from the start), checked against the recording."""
    if at is None:
        return recording.end if default_end else recording.start
    if at < 0 or at > recording.duration + 1e-6:
        raise ReplayError(f"--at {at:g} is outside the recording (0 to {recording.duration:.1f} s)")
    return recording.start + at


def run(args: argparse.Namespace) -> int:
    if args.json and not args.once:
        raise ReplayError("--json needs --once")
    from memtop.engine.playback import Player
    from memtop.engine.store import Store

    recording = open_recording(args.path)
    store = Store()
    for note in recording.notes:  # on the dashboard's status line
        store.note(note)
    player = Player(store, recording, interval=getattr(args, "interval", 1.0) or 1.0)
    if args.once:
        return _once(args, recording, store, player)
    return _dashboard(args, recording, store, player)


def _host(recording: Recording) -> str:
    host = recording.header.get("host")
    return str(host) if isinstance(host, str) and host else "replay"


def _once(args: argparse.Namespace, recording: Recording, store: Store, player: Player) -> int:
    from memtop import protocol
    from memtop.engine.observation import Observer
    from memtop.present import report

    player.seek(moment(recording, args.at, default_end=True))
    observer = Observer(store, clock=player.clock, host=_host(recording))
    data = report.build(observer.latest())
    player.read_to_end()  # the skipped lines below, from this reading (not a second one)
    data["replay"] = {
        "files": [protocol.clean_text(str(f)) for f in recording.files],  # names from a listing
        "kind": recording.kind,
        "started": recording.start,
        "duration_s": round(recording.duration, 3),
        "at_s": round(player.offset, 3),
        "skipped_lines": recording.skipped_count,
        "notes": list(recording.notes),  # files not read to their end, and why
    }
    for note in recording.notes:
        print(f"memtop: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        names = ", ".join(protocol.clean_text(f.name) for f in recording.files)
        at = f"replay of {names} at {player.offset:.1f} s"
        sys.stdout.write(f"{at} of {recording.duration:.1f} s\n" + report.render_text(data))
    return 0


def _dashboard(args: argparse.Namespace, recording: Recording, store: Store, player: Player) -> int:
    from memtop.ui.replay_app import ReplayApp

    if not (sys.stdout.isatty() and sys.stdin.isatty()):
        raise ReplayError("the replay dashboard needs a terminal; use --once [--json] [--at S]")
    player.seek(moment(recording, args.at, default_end=False))
    if args.speed > 0:
        player.speed = args.speed
    try:
        ReplayApp(store, player, recording, host=_host(recording)).run()
    finally:
        player.stop()
    return 0
