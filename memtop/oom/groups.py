"""OOMs that come back (issue 25.5): reports grouped by fingerprint, so "the same OOM 5 times in
3 runs since Tue 14:02" is one entry, explained once, instead of five.

The fingerprint: the command, the diagnosed cause, the failing line when the report has one
(its `stack`'s innermost user frame), and the request's size class (powers of two: a 1.9 GiB
and a 2.1 GiB request are one class, a 200 MiB one another).  A run is one process on one host
(host, pid).  Groups come newest first (by their newest report).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from memtop.base.records import record
from memtop.figures.units import format_bytes
from memtop.oom.diagnose import diagnose
from memtop.oom.reports import Report


def size_class(requested: object) -> str:
    """The request's power-of-two class: `1 GiB–2 GiB` for 1.5 GiB; `?` when unknown."""
    if isinstance(requested, bool) or not isinstance(requested, int) or requested <= 0:
        return "?"
    low = 1 << int(math.log2(requested))
    return f"{format_bytes(low)}–{format_bytes(low * 2)}"


def failing_line(data: dict[str, Any]) -> str | None:
    """`file:line` of the failing allocation's innermost user frame, when the report has it."""
    stack = data.get("stack")
    if not isinstance(stack, list) or not stack or not isinstance(stack[0], dict):
        return None
    frame = stack[0]
    file, line = frame.get("file"), frame.get("line")
    if not isinstance(file, str) or not isinstance(line, int) or isinstance(line, bool):
        return None
    return f"{file}:{line}"


def command_of(data: dict[str, Any]) -> str:
    return " ".join(str(a) for a in data.get("argv") or [])


@record(frozen=True, slots=True)
class OomGroup:
    command: str
    cause: str
    line: str | None
    size: str
    reports: tuple[Report, ...]  # newest first

    @property
    def runs(self) -> int:
        return len({(r.data.get("host"), r.data.get("pid")) for r in self.reports})

    @property
    def first_time(self) -> float | None:
        times = [t for r in self.reports if isinstance(t := r.data.get("time"), int | float)]
        return min(times) if times else None

    @property
    def newest(self) -> Report:
        return self.reports[0]

    def headline(self) -> str:
        """`the same OOM 5 times in 3 runs since Tue 14:02` (or `1 OOM` for a single one)."""
        n = len(self.reports)
        if n == 1:
            return "1 OOM"
        runs = self.runs
        since = _since(self.first_time)
        return f"the same OOM {n} times in {runs} run{'s' if runs != 1 else ''}" + (
            f" since {since}" if since else ""
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "cause": self.cause,
            "line": self.line,
            "size_class": self.size,
            "count": len(self.reports),
            "runs": self.runs,
            "first_time": self.first_time,
            "last_time": self.newest.data.get("time"),
            "headline": self.headline(),
            "diagnosis": diagnose(self.newest.data),
            "reports": [str(r.path) for r in self.reports],
        }


def _since(t: float | None) -> str:
    if t is None:
        return ""
    return time.strftime("%a %H:%M", time.localtime(t))


def fingerprint(data: dict[str, Any]) -> tuple[str, str, str | None, str]:
    return (
        command_of(data),
        str(diagnose(data).get("cause")),
        failing_line(data),
        size_class(data.get("requested_bytes")),
    )


def group_reports(reports: Sequence[Report]) -> list[OomGroup]:
    """Reports (any order) grouped by fingerprint; each group's reports and the groups
    themselves newest first."""

    def when(report: Report) -> float:
        t = report.data.get("time")
        return float(t) if isinstance(t, int | float) and not isinstance(t, bool) else 0.0

    found: dict[tuple[str, str, str | None, str], list[Report]] = {}
    for report in sorted(reports, key=when, reverse=True):
        found.setdefault(fingerprint(report.data), []).append(report)
    groups = [OomGroup(*key, reports=tuple(members)) for key, members in found.items()]
    return sorted(groups, key=lambda g: when(g.newest), reverse=True)
