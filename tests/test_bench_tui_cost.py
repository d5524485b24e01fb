"""Smoke test of bench/tui_cost.py: the dashboard in a pty on one simulated GPU, briefly; with
nvitop beside it where nvitop is installed (it is not a memtop dependency)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "tui_cost.py"


@pytest.mark.slow
def test_the_dashboard_cost_benchmark_runs_and_reports_its_figures():
    tools = "memtop,nvitop" if importlib.util.find_spec("nvitop") else "memtop"
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            *("--seconds", "2", "--gpus", "1", "--warmup", "1", "--pairs", "1", "--settle", "2"),
            *("--tools", tools, "--scenarios", "healthy"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["gpus"] == 1 and result["agents"] == 1
    assert set(result["scenarios"]) == {"healthy"} and result["scenario"] == "healthy"
    (memtop,) = result["runs"]["memtop"]
    assert memtop["first_frame_s"] > 0
    assert memtop["first_data_s"] is not None and memtop["first_data_s"] >= memtop["first_frame_s"]
    assert memtop["cpu_percent"] >= 0 and memtop["rss_mb"] > 10
    assert memtop["tty_bytes_per_s"] > 0
    assert memtop["exit_code"] == 0 and memtop["load_1min"] >= 0
    assert set(result["goals_met"]) >= {"first_data", "full_frame", "rss"}
    if "nvitop" in tools:
        (nvitop,) = result["runs"]["nvitop"]
        assert nvitop["first_frame_s"] > 0 and nvitop["exit_code"] == 0
        assert set(result["ratios"]) == {
            "cpu_percent",
            "tty_bytes_per_s",
            "first_frame_s",
            "rss_mb",
        }
        assert set(result["goals_met"]) == {"first_data", "full_frame", "rss", "cpu", "tty_bytes"}


def test_the_benchmark_starts_memtop_from_bytecode(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # A checkout run with PYTHONDONTWRITEBYTECODE compiled every module at each start (~0.15 s
    # of CPU): the bench measured that, where an installed memtop (and nvitop) loads bytecode.
    import importlib

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(BENCH.parent))
    tui_cost = importlib.import_module("tui_cost")
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "mod.py").write_text("X = 1\n")
    tui_cost.compile_bytecode(package)
    for source in (package / "__init__.py", package / "sub" / "mod.py"):
        assert Path(importlib.util.cache_from_source(str(source))).is_file(), source


def test_the_full_frame_marker_is_only_on_the_table_laid_out_for_its_width(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # "Processes" (the table's border title), the marker the bench counted the full frame by,
    # was on Textual's first frame too, whose table was laid out for no width (no USER, CPU%,
    # RSS or TIME column): the full frame it reported was that wrong one.
    import importlib

    from memtop.ui.widgets.process_table import GAP, ProcessTable

    monkeypatch.syspath_prepend(str(BENCH.parent))
    tui_cost = importlib.import_module("tui_cost")
    table = ProcessTable()

    def header(content_width: int) -> bytes:
        _, columns, widths = table._lay_out(content_width)
        return table._header_text(columns, widths, GAP)[0].plain.encode()

    marker = tui_cost.full_frame_marker((120, 36))
    for columns in (120, 100, 200):  # the table's content: the terminal's less border and padding
        assert marker.search(header(columns - 4)), (columns, header(columns - 4))
        assert tui_cost.full_frame_marker((columns, 36)).pattern == marker.pattern
    assert not marker.search(header(0))  # laid out before Textual's first layout
    assert tui_cost.full_frame_marker((80, 24)).pattern == rb"Processes"  # compact: no USER
