"""Reading OOM reports: only this user's regular files in the OOM directory, none larger than a
report can be, parsed as untrusted JSON (a report was written by a trainer, and a trainer is
code we do not control: memtop.untrusted bounds its depth and its numbers), every string made
inert and encodable for a terminal.  One report that cannot be read is one line in the list,
never the end of it."""

from __future__ import annotations

import contextlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memtop import protocol, untrusted
from memtop.errors import MemtopError

REPORT_NAME = re.compile(r"^oom-(\d+)-(\d+)\.json$")  # as memtop.agent.oom writes them
MAX_READ_BYTES = 1 << 20


class ReportError(MemtopError):
    """A report that cannot be read: one line for the user."""


@dataclass(frozen=True, slots=True)
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
