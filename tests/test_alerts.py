"""The alerting rules that ship (issue 33.4): `contrib/prometheus/memtop-alerts.yml` passes
promtool's own unit tests (a firing and a silent case for each rule), and every metric a rule or
the Grafana dashboard queries is one the exporter serves (tests/test_prometheus.py checks that
against a real scrape of `memtop export`; the names come from here)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "contrib" / "prometheus" / "memtop-alerts.yml"
RULE_TESTS = ROOT / "contrib" / "prometheus" / "memtop-alerts.test.yml"
DASHBOARD = ROOT / "contrib" / "grafana" / "memtop.json"

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="no promtool (apt-get install -y prometheus; .ci/run installs it)",
)


def rule_names() -> list[str]:
    return re.findall(r"^\s+- alert: (\w+)$", RULES.read_text(), re.M)


def queried_metrics() -> set[str]:
    """Every memtop metric a rule's or a dashboard panel's expression names."""
    exprs = [m.group(1) for m in re.finditer(r"expr: (\|\n(?:\s{10}.*\n)+|.*)", RULES.read_text())]
    dashboard = json.loads(DASHBOARD.read_text())

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "query") and isinstance(value, str):
                    exprs.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(dashboard)
    return {name for expr in exprs for name in re.findall(r"\bmemtop_[a-z_]+\b", expr)}


@needs_promtool
def test_the_rules_pass_promtools_checks_and_unit_tests():
    check = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(rule_names())} rules found" in check.stdout
    tests = subprocess.run(
        ["promtool", "test", "rules", RULE_TESTS.name],
        cwd=RULE_TESTS.parent, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert tests.returncode == 0 and "SUCCESS" in tests.stdout, tests.stdout + tests.stderr


@needs_promtool
def test_a_rule_that_no_longer_fires_fails_its_unit_test(tmp_path: Path):
    """The unit tests can fail: with the leak rule's threshold halved, its firing case fails."""
    (tmp_path / RULES.name).write_text(RULES.read_text().replace("< 3600", "< 1800", 1))
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    tests = subprocess.run(
        ["promtool", "test", "rules", RULE_TESTS.name],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert tests.returncode != 0
    assert "MemtopGpuFullWithinAnHour" in tests.stdout + tests.stderr


def test_each_rule_waits_says_what_to_do_and_has_a_firing_case():
    text = RULES.read_text()
    blocks = re.split(r"\n\s+- alert: ", text)[1:]
    assert len(blocks) == len(rule_names()) >= 8
    for block in blocks:
        name = block.split("\n", 1)[0]
        assert re.search(r"\n\s+for: \d+m\n", block), f"{name} has no for:"
        assert re.search(r"\n\s+runbook: .{40,}", block), f"{name} has no runbook line"
        assert re.search(r"severity: (page|ticket)", block), name
    tests = RULE_TESTS.read_text()
    for name in rule_names():
        firing = re.search(rf"alertname: {name}\n\s+exp_alerts:\n\s+- exp_labels", tests)
        assert firing, f"{name} has no case in which it fires"


def test_the_queried_names_are_found_in_the_rules_and_the_dashboard():
    names = queried_metrics()
    assert {"memtop_time_to_full_seconds", "memtop_ooms_total", "memtop_agent_info"} <= names
    assert "memtop_leak_bytes_per_second" in names  # from the dashboard
