"""`memtop record -o FILE [--seconds S]`: write everything the sampler reads, as it reads it.

The sampler runs as for the dashboard; a tap writes each driver reading, each change of the
process list and of an agent's state, and every agent reply as it came over the wire
(memtop.sources.recording).  The file is usable while it grows and after a crash: the writer
flushes at least every second.  `memtop replay FILE` plays it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

from memtop.base import children
from memtop.base.errors import MemtopError


def add_arguments(record: argparse.ArgumentParser) -> None:
    """`memtop record`'s arguments (its name and help are in memtop.commands.parser)."""
    record.add_argument("-o", "--output", required=True, type=Path, metavar="FILE")
    record.add_argument(
        "--seconds", type=float, default=None, help="stop after this long (default: Ctrl-C)"
    )
    record.add_argument("--force", action="store_true", help="overwrite an existing file")
    record.add_argument(
        "--interval", type=float, default=argparse.SUPPRESS, help="sampling interval"
    )


def run(args: argparse.Namespace) -> int:
    from memtop.engine.sampler import Sampler
    from memtop.engine.store import Store
    from memtop.sources.agents import AgentPool
    from memtop.sources.devices import DefaultDeviceSource
    from memtop.sources.recording import RecordWriter

    interval = getattr(args, "interval", None) or 1.0
    if interval <= 0:
        raise MemtopError("--interval must be greater than 0")
    if args.seconds is not None and args.seconds <= 0:
        raise MemtopError("--seconds must be greater than 0")
    path: Path = args.output
    if not path.parent.resolve().is_dir():
        raise MemtopError(f"no such directory: {path.parent}")
    writer = RecordWriter(path, overwrite=args.force)  # a RecordError is said in one line

    agents = AgentPool(args.socket_dir)
    agents.tap = writer.agent_reply
    sampler = Sampler(Store(), DefaultDeviceSource(args.socket_dir), agents, interval=interval)
    sampler.tap = writer
    stop = children.StopFlag()  # raised by SIGTERM: not a threading.Event (children.StopFlag)

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    previous = signal.signal(signal.SIGTERM, on_signal)
    started = time.monotonic()
    until = f"for {args.seconds:g} s" if args.seconds else "until Ctrl-C"
    print(f"memtop record: writing {path} {until}", file=sys.stderr, flush=True)
    rounds = 0
    try:
        while not stop.is_set():
            deadline = time.monotonic() + interval
            try:
                sampler.sample_once()
            except Exception as exc:  # keep recording; say what happened, in the file too
                sampler.store.note(f"sampler: {type(exc).__name__}: {exc}")
            rounds += 1
            writer.flush()  # at most one round (≤ a second by default) lost in a crash
            if args.seconds is not None and time.monotonic() - started >= args.seconds:
                break
            left = deadline - time.monotonic()
            if args.seconds is not None:
                left = min(left, args.seconds - (time.monotonic() - started))
            stop.wait(max(0.0, left))
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        sampler.stop()
        writer.close()
    agents_seen = len(sampler.store.agents())
    size = path.stat().st_size if path.exists() else 0
    print(
        f"memtop record: {rounds} rounds, {writer.lines} lines, {agents_seen} agent(s), "
        f"{size / 1024:.0f} KiB in {path}",
        file=sys.stderr,
    )
    return 0
