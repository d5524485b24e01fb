"""Smoke test of bench/tui_cost.py: the dashboard in a pty on one simulated GPU, briefly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "tui_cost.py"


@pytest.mark.slow
def test_the_dashboard_cost_benchmark_runs_and_reports_its_figures():
    out = subprocess.run(
        [sys.executable, str(BENCH), "--seconds", "2", "--gpus", "1", "--warmup", "1"],
        capture_output=True,
        text=True,
        timeout=90,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result) >= {
        "first_frame_s",
        "first_data_s",
        "cpu_percent",
        "tty_bytes_per_s",
        "rss_mb",
        "seconds",
        "gpus",
        "agents",
        "interval",
        "size",
        "exit_code",
        "within_budget",
    }
    assert set(result["within_budget"]) == {"cpu", "tty_bytes", "first_frame", "rss"}
    assert result["gpus"] == 1 and result["agents"] == 1
    assert result["first_frame_s"] > 0
    assert result["first_data_s"] is not None and result["first_data_s"] >= result["first_frame_s"]
    assert result["cpu_percent"] >= 0
    assert result["tty_bytes_per_s"] > 0
    assert result["rss_mb"] > 10
    assert result["exit_code"] == 0
