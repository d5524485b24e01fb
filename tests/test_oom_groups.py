"""OOMs that come back (issue 25.5): `memtop oom` groups reports by fingerprint (command, cause,
failing line, request size class), newest first, each group explained once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memtop.agent.oom import report_name
from memtop.base import children
from memtop.cli import main
from memtop.oom.groups import size_class
from memtop.sim.demo import registry_dir
from memtop.sim.device import SimGpuRegistry, simulated_gpu_specs

GiB = 2**30
MiB = 2**20


def report(pid: int, at: float, requested: int, argv: list[str], **extra: object) -> dict:  # type: ignore[type-arg]
    return {
        "memtop_oom_report": 1,
        "time": at,
        "host": "box",
        "pid": pid,
        "argv": argv,
        "step": 100,
        "phase": "backward",
        "requested_bytes": requested,
        "limit_bytes": 80 * GiB,
        "total_bytes": 80 * GiB,
        "free_bytes": 1 * GiB,
        "allocated_bytes": 70 * GiB,
        "reserved_bytes": 78 * GiB,
        "largest_free_block_bytes": 3 * GiB,
        "recent": [],
        "allocator_conf": "",
        **extra,
    }


@pytest.fixture
def oom_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "oom"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv("MEMTOP_OOM_DIR", str(directory))
    return directory


def test_size_classes_are_powers_of_two() -> None:
    assert size_class(int(1.9 * GiB)) == size_class(int(1.1 * GiB)) == "1.0 GiB–2.0 GiB"
    assert size_class(200 * MiB) != size_class(2 * GiB)
    assert size_class(None) == size_class(True) == size_class(0) == "?"


def test_the_same_oom_five_times_in_three_runs_is_one_group(
    oom_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = [{"file": "train.py", "line": 88, "function": "step", "text": "out = model(x)"}]
    same = [
        report(pid, at, requested, ["python", "train.py"], stack=stack)
        for pid, at, requested in (
            (11, 1000.0, int(2.2 * GiB)),
            (11, 1060.0, int(2.5 * GiB)),
            (12, 2000.0, int(2.1 * GiB)),
            (13, 3000.0, int(2.9 * GiB)),
            (13, 3100.0, int(2.0 * GiB)),
        )
    ]
    other_line = report(14, 3050.0, int(2.2 * GiB), ["python", "train.py"])  # no stack
    small = report(15, 3200.0, 100 * MiB, ["python", "train.py"], stack=stack)  # newest
    for rep in [*same, other_line, small]:
        (oom_dir / report_name(rep["time"], rep["pid"])).write_text(json.dumps(rep))
    assert main(["oom", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert len(listed["reports"]) == 7  # the list of reports is kept as it was
    groups = listed["groups"]
    assert [g["count"] for g in groups] == [1, 5, 1]  # newest group first
    group = groups[1]
    assert (group["runs"], group["line"], group["size_class"]) == (
        3,
        "train.py:88",
        "2.0 GiB–4.0 GiB",
    )
    since = time.strftime("%a %H:%M", time.localtime(1000.0))
    assert group["headline"] == f"the same OOM 5 times in 3 runs since {since}"
    assert group["last_time"] == 3100.0 and group["first_time"] == 1000.0
    assert main(["oom"]) == 0
    text = capsys.readouterr().out
    assert "7 OOM report(s)" in text and "(3 distinct)" in text
    assert f"the same OOM 5 times in 3 runs since {since} at train.py:88" in text
    assert text.count("fix:") == 3  # each group explained once
    assert "and 4 more" in text


@pytest.mark.slow
def test_three_runs_of_a_trainer_that_ooms_are_one_group(tmp_path: Path) -> None:
    """Real reports: three runs of a simulated trainer whose batch grows until it runs out."""
    sockets, ooms = tmp_path / "s", tmp_path / "o"
    sockets.mkdir(mode=0o700)
    ooms.mkdir(mode=0o700)
    registry = registry_dir(sockets, os.getpid())
    SimGpuRegistry(registry).create(simulated_gpu_specs(1, total_bytes=16 * GiB))
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(sockets), MEMTOP_OOM_DIR=str(ooms))
    for run in range(3):
        trainer = subprocess.Popen(
            [sys.executable, "-m", "memtop.sim.trainer", "--registry", str(registry),
             "--scenario", "oom", "--step-time", "0.02"],
            env=env,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while len(list(ooms.glob("oom-*.json"))) <= run:
                assert time.monotonic() < deadline, "no OOM report"
                time.sleep(0.1)
        finally:
            children.stop(trainer)
    listed = subprocess.run(
        [sys.executable, "-m", "memtop", "oom", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    groups = json.loads(listed.stdout)["groups"]
    assert [(g["count"], g["runs"], g["cause"]) for g in groups] == [(3, 3, "growing_batch")]
    shown = subprocess.run(
        [sys.executable, "-m", "memtop", "oom"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "the same OOM 3 times in 3 runs since " in shown and shown.count("fix:") == 1
