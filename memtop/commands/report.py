"""`memtop report FILE|DIR -o report.html`: one self-contained HTML page from a recording
(`memtop record`, or agents' wire recordings such as shared/traces), to hand on (issue 33.3).

The output is checked as a snapshot's is (`snapshot_output`): never written through a symbolic
link, an existing file only with `--force`; it is created with O_NOFOLLOW besides.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from memtop.base.errors import MemtopError
from memtop.commands import EXIT_OK


def add_arguments(report: argparse.ArgumentParser) -> None:
    """`memtop report`'s arguments (its name and help are in memtop.commands.parser)."""
    report.add_argument("path", type=Path, help="a recording (.memtop, .jsonl.gz) or a folder")
    report.add_argument(
        "-o", "--output", type=Path, default=Path("memtop-report.html"), help="the page to write"
    )
    report.add_argument("--force", action="store_true", help="overwrite an existing file")
    report.add_argument("--title", help="the page's title (default: the recording's name)")


def run(args: argparse.Namespace) -> int:
    from memtop.commands.actions import snapshot_output
    from memtop.commands.replay import open_recording
    from memtop.present import html_report

    output = snapshot_output(args.output, 0, args.force)
    recording = open_recording(args.path)
    title = args.title or f"memtop report: {args.path.name}"
    page = html_report.build(recording, title).encode()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    if not args.force:
        flags |= os.O_EXCL
    try:
        fd = os.open(output, flags, 0o644)
    except FileExistsError:
        raise MemtopError(f"{output} exists; add --force to overwrite it") from None
    except OSError as exc:
        raise MemtopError(f"cannot write {output}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "wb") as fh:
        fh.write(page)
    for note in recording.notes:
        print(f"memtop: {note}", file=sys.stderr)
    print(f"memtop report: wrote {output} ({len(page) / 1024:.0f} KiB)")
    return EXIT_OK
