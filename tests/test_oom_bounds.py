"""One OOM report costs bounded work (issue 36, item 9): a 1 MB report of valid JSON (6,000 step
marks, 27,000 OOM times, a 500-frame stack) took `memtop oom` 21 s of CPU (41 s in the audit),
every mark walking every OOM time.  A report's lists are cut to what an agent writes, and "an
OOM between two marks" is a binary search."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from memtop.oom.diagnose import step_sizes
from memtop.oom.reports import LIST_BOUNDS, load_report

MARKS, OOMS = 6000, 27000


def big_report(path: Path) -> Path:
    recent = [
        {"step": i, "time": 1000.0 + i, "allocated_bytes": 10_000_000 + i,
         "allocated_total_bytes": i * 1000}
        for i in range(MARKS)
    ]  # fmt: skip
    report = {
        "memtop_oom_report": 1, "time": 2000.0, "pid": 1, "step": MARKS, "phase": "forward",
        "device": 0, "requested_bytes": 1 << 30, "allocated_bytes": 1 << 33,
        "reserved_bytes": 1 << 34, "free_bytes": 1 << 20, "total_bytes": 1 << 36,
        "largest_free_block_bytes": 1 << 20, "inactive_split_bytes": 0, "breakdown": {},
        "recent": recent, "recent_ooms": [{"time": -float(i)} for i in range(OOMS)],
        "stack": [{"file": "train.py", "line": i, "function": "f", "text": ""} for i in range(500)],
        "allocator_conf": "", "diagnosis": {"cause": "too_big", "detail": "x", "fix": "y"},
    }  # fmt: skip
    path.write_text(json.dumps(report, separators=(",", ":")))
    assert 900_000 < path.stat().st_size < 1 << 20  # under the read cap: read in full
    return path


def test_a_reports_lists_are_cut_to_what_an_agent_writes(tmp_path: Path) -> None:
    data = load_report(big_report(tmp_path / "oom-1-1.json")).data
    assert len(data["recent"]) == LIST_BOUNDS["recent"][0] < MARKS
    assert data["recent"][-1]["step"] == MARKS - 1  # the newest marks kept
    assert len(data["recent_ooms"]) == LIST_BOUNDS["recent_ooms"][0]
    assert len(data["stack"]) == LIST_BOUNDS["stack"][0] and data["stack"][0]["line"] == 0


def test_memtop_oom_reads_a_1_mb_report_in_bounded_cpu(tmp_path: Path) -> None:
    path = big_report(tmp_path / "oom-1-1.json")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(
        [sys.executable, "-m", "memtop.cli", "oom", str(path)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ),
    )  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    # Diagnosed whole (the cause's name on its line: without the driver's per-process split,
    # whose memory it was is "not known", issue 31 item 7).
    said = result.stdout
    assert result.returncode == 0 and "\nunknown_holder: needed 1.0 GiB" in said, result.stderr
    assert cpu < 5.0, f"{cpu:.1f} s of CPU"  # 0.2 s now, 21 s before


def test_an_oom_between_two_marks_ends_a_run() -> None:
    marks = [
        {"step": s, "time": float(s), "allocated_total_bytes": 100 * s * s} for s in range(1, 8)
    ]
    assert [len(r) for r in step_sizes(marks)] == [6]
    assert [len(r) for r in step_sizes(marks, [3.5])] == [2, 3]  # the interval 3-4 left out
    assert [len(r) for r in step_sizes(marks, [4.0, 100.0, -5.0])] == [2, 3]  # t <= when
    assert [len(r) for r in step_sizes(marks, [1.0])] == [6]  # at the first mark: before all
