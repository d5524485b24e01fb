"""`memtop compare A B`: two runs side by side (memtop.present.compare).  A and B are each a
recording
(file or folder) or a live pid: a number is a live trainer's pid (a file named so is `./N`),
sampled for `--seconds`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from memtop.base.errors import MemtopError
from memtop.commands import EXIT_OK, common


def add_arguments(compare: argparse.ArgumentParser) -> None:
    """`memtop compare`'s arguments (its name and help are in memtop.commands.parser)."""
    compare.add_argument("a", help="a recording (file or folder) or a live pid")
    compare.add_argument("b", help="a recording (file or folder) or a live pid")
    compare.add_argument("--a-pid", type=int, help="the process in A, when it holds several")
    compare.add_argument("--b-pid", type=int, help="the process in B, when it holds several")
    compare.add_argument(
        "--seconds", type=float, default=10.0, help="how long to sample a live pid (default 10)"
    )
    compare.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from memtop.present import compare

    try:
        a = _run(args, args.a, "A", args.a_pid)
        b = _run(args, args.b, "B", args.b_pid)
    except compare.CompareError as exc:
        raise MemtopError(str(exc)) from None
    result = compare.compare(a, b)
    if args.json:
        print(json.dumps(compare.as_json(result), indent=2))
    else:
        sys.stdout.write(compare.render_text(result))
    return EXIT_OK


def _run(args: argparse.Namespace, source: str, label: str, pid: int | None):  # type: ignore[no-untyped-def]
    from memtop.present import compare

    if source.isdigit():
        return compare.run_of(_live(args, int(source)), label, int(source))
    from memtop.commands.replay import open_recording
    from memtop.engine.playback import Player
    from memtop.engine.store import Store

    recording = open_recording(Path(source))
    store = Store()
    Player(store, recording).seek(recording.end)
    try:
        return compare.run_of(store, label, pid)
    except compare.CompareError as exc:
        raise MemtopError(f"{exc} (--{label.lower()}-pid)") from None


def _live(args: argparse.Namespace, pid: int):  # type: ignore[no-untyped-def]
    sampling = argparse.Namespace(socket_dir=args.socket_dir, interval=0.5)
    sampler = common.make_sampler(sampling)
    try:
        deadline = time.monotonic() + max(1.0, args.seconds)
        while time.monotonic() < deadline:
            sampler.sample_once()
            time.sleep(0.5)
    finally:
        sampler.stop()
    if not any(a.pid == pid for a in sampler.store.view().agents):
        raise MemtopError(f"no memtop agent answers for pid {pid} (memtop run, or attach it)")
    return sampler.store
