"""`memtop oom` output: the list (newest first) and one report explained; text and JSON."""

from __future__ import annotations

import time
from typing import Any

from memtop.base.user_frame import site_name, stack_phrase
from memtop.figures.units import format_bytes
from memtop.oom.diagnose import diagnose
from memtop.oom.groups import group_reports
from memtop.oom.reports import Report

# The report fields the list carries (DESIGN §11), beside the diagnosis.
SUMMARY_FIELDS = (
    "time",
    "host",
    "pid",
    "rank",
    "step",
    "phase",
    "device",
    "device_name",
    "requested_bytes",
    "allocated_bytes",
    "reserved_bytes",
    "free_bytes",
    "limit_bytes",
    "largest_free_block_bytes",
    "inactive_split_bytes",
    "allocator_conf",
    "stack",
)


def summary_json(report: Report) -> dict[str, Any]:
    data = report.data
    out: dict[str, Any] = {"path": str(report.path)}
    out.update({key: data.get(key) for key in SUMMARY_FIELDS})
    out["command"] = " ".join(str(a) for a in data.get("argv") or [])
    out["diagnosis"] = diagnose(data)
    return out


def list_json(directory: str, reports: list[Report], problems: list[str]) -> dict[str, Any]:
    return {
        "directory": directory,
        "reports": [summary_json(r) for r in reports],
        # The same OOM coming back, one entry per fingerprint, newest first (issue 25).
        "groups": [group.as_json() for group in group_reports(reports)],
        "unreadable": problems,
    }


def report_json(report: Report) -> dict[str, Any]:
    return {**report.data, "path": str(report.path), "diagnosis": diagnose(report.data)}


def _when(t: Any) -> str:
    if not isinstance(t, int | float) or isinstance(t, bool):
        return "?"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (OverflowError, ValueError, OSError):  # a time no clock reaches (1e18)
        return "?"


def list_text(directory: str, reports: list[Report], problems: list[str]) -> str:
    if not reports:
        lines = [f"no OOM reports in {directory}"]
    else:
        groups = group_reports(reports)
        distinct = f" ({len(groups)} distinct)" if len(groups) < len(reports) else ""
        lines = [f"{len(reports)} OOM report(s) in {directory}{distinct}, newest first:", ""]
        for group in groups:
            # One OOM that came back is explained once, from its newest report.
            report = group.newest
            data = report.data
            verdict = diagnose(data)
            command = " ".join(str(a) for a in data.get("argv") or [])[:60]
            if len(group.reports) > 1:
                where = f" at {group.line}" if group.line else ""
                lines.append(f"{group.headline()}{where} (requests of {group.size}); the newest:")
            lines.append(
                f"{_when(data.get('time'))}  pid {data.get('pid')}  GPU {data.get('device')}  "
                f"step {data.get('step')}  {data.get('phase')}  {command}"
            )
            lines.append(f"  {verdict['cause']}: {verdict['detail']}")
            failing = stack_phrase(data.get("stack"), function=True)
            if failing:
                lines.append(f"  the failing request: {failing}")
            lines.append(f"  fix: {verdict['fix']}")
            lines.append(f"  {report.path}")
            if len(group.reports) > 1:
                lines.append(f"  and {len(group.reports) - 1} more (memtop oom --json lists them)")
    lines += [f"unreadable: {p}" for p in problems]
    return "\n".join(lines)


def report_text(report: Report) -> str:
    data = report.data
    verdict = diagnose(data)
    b = format_bytes
    lines = [
        f"OOM in pid {data.get('pid')} on {data.get('host')} at {_when(data.get('time'))}",
        f"  command   {' '.join(str(a) for a in data.get('argv') or [])}",
        f"  GPU {data.get('device')} {data.get('device_name') or ''}".rstrip(),
        f"  step {data.get('step')}, phase {data.get('phase')} "
        f"(framework: {data.get('framework_phase')})",
        f"  requested {b(data.get('requested_bytes'))}; "
        f"allocated {b(data.get('allocated_bytes'))}, "
        f"reserved {b(data.get('reserved_bytes'))}, limit {b(data.get('limit_bytes'))}",
        f"  free on the GPU {b(data.get('free_bytes'))}; largest free block in the cache "
        f"{b(data.get('largest_free_block_bytes'))}; "
        f"inactive split {b(data.get('inactive_split_bytes'))}",
        f"  baseline at the last step {b(data.get('baseline_bytes'))}; "
        f"peak {b(data.get('peak_bytes'))}",
        f"  allocator config: {data.get('allocator_conf') or '(default)'}",
    ]
    if data.get("own_non_pytorch_bytes") is not None:
        lines.append(
            f"  the driver: this process outside PyTorch {b(data.get('own_non_pytorch_bytes'))}, "
            f"other processes {b(data.get('other_processes_bytes'))}"
        )
    breakdown = data.get("breakdown")
    if isinstance(breakdown, dict):
        lines.append(
            f"  breakdown at step {breakdown.get('step')}: "
            f"parameters {b(breakdown.get('parameters'))}, "
            f"gradients {b(breakdown.get('gradients'))}, "
            f"optimizer state {b(breakdown.get('optimizer_state'))}, "
            f"other {b(breakdown.get('other'))}"
        )
    stack = data.get("stack")
    where = stack_phrase(stack, function=True)
    if where:
        # The failing request's own line (DESIGN §12), then the user frames that called it.
        lines.insert(5, f"  the failing request {where}")
    if isinstance(stack, list) and len(stack) > 1:
        lines.append("  called from")
        for frame in stack[1:]:
            name = site_name(frame)
            if name:
                lines.append(f"    {name}")
    recent = data.get("recent") or []
    lines.append(f"  {len(recent)} step marks in the last {data.get('recent_window_s')} s")
    lines += ["", f"{verdict['cause']}: {verdict['detail']}", f"fix: {verdict['fix']}"]
    if verdict.get("also"):
        lines.append(f"also in view: {', '.join(verdict['also'])}")
    return "\n".join(lines)
