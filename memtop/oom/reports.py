"""Reading OOM reports: only this user's regular files in the OOM directory, none larger than a
report can be, parsed as untrusted JSON (a report was written by a trainer, and a trainer is
code we do not control: memtop.base.untrusted bounds its depth and its numbers), every string made
inert and encodable for a terminal.  One report that cannot be read is one line in the list,
never the end of it."""

from __future__ import annotations

import contextlib
import os
import re
import stat
from pathlib import Path
from typing import Any

from memtop import protocol
from memtop.base import untrusted
from memtop.base.errors import MemtopError
from memtop.base.records import record

REPORT_NAME = re.compile(r"^oom-(\d+)-(\d+)\.json$")  # as memtop.agent.oom writes them
MAX_READ_BYTES = 1 << 20
# The lists of a report, cut to what an agent writes (memtop.agent.oom: at most 256 KiB, the step
# marks of the last 60 s, the last 256 OOM events, a few user frames, the top sites) so that
# one report costs bounded work: a 1 MB file of 6,000 marks and 29,000 OOM times took
# `memtop oom` 21 s of CPU.  Each list keeps its newest entries ("tail") or its first ("head").
LIST_BOUNDS = {
    "recent": (4096, "tail"),  # oldest first
    "recent_ooms": (256, "tail"),
    "stack": (16, "head"),  # innermost first
    "sites": (64, "head"),  # largest first
    "argv": (256, "head"),
}


class ReportError(MemtopError):
    """A report that cannot be read: one line for the user."""


@record(frozen=True, slots=True)
class Report:
    path: Path
    data: dict[str, Any]


def load_report(path: Path) -> Report:
    try:
        data = untrusted.load_json_file(path, MAX_READ_BYTES, follow_symlinks=False)
    except OSError as exc:
        raise ReportError(f"cannot open {path}: {exc.strerror}") from None
    except untrusted.UntrustedInput as exc:
        raise ReportError(f"{path} {exc}") from None
    if not isinstance(data, dict) or data.get("memtop_oom_report") != 1:
        raise ReportError(f"{path} is not a memtop OOM report")
    for key, (bound, keep) in LIST_BOUNDS.items():
        value = data.get(key)
        if isinstance(value, list) and len(value) > bound:
            data[key] = value[-bound:] if keep == "tail" else value[:bound]
    return Report(path, protocol.clean_value(data))


def list_reports(directory: Path | None = None) -> tuple[Path, list[Report], list[str]]:
    """(the directory, its readable reports newest first, one line per unreadable one)."""
    directory = directory or protocol.oom_dir()
    names = []
    with (
        contextlib.suppress(FileNotFoundError, NotADirectoryError),
        os.scandir(directory) as entries,
    ):
        for entry in entries:
            match = REPORT_NAME.match(entry.name)
            if match is None:
                continue
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(info.st_mode) and info.st_uid in (os.getuid(), 0):
                    names.append((int(match.group(1)), entry.name))
    reports, problems = [], []
    for _, name in sorted(names, reverse=True):
        try:
            reports.append(load_report(directory / name))
        except ReportError as exc:
            problems.append(str(exc))
    return directory, reports, problems
