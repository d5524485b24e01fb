"""`memtop compare A B` (issue 34.3): two runs side by side, each difference judged against
the runs' own noise; on the real H100 recordings and on live simulated trainers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memtop.cli import main

TRACES = Path(__file__).resolve().parent / "data" / "traces"


def _compare(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["compare", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _diff(result: dict, figure: str) -> dict:
    return next(d for d in result["differences"] if d["figure"] == figure)


def test_expandable_segments_hold_less_reserved_beyond_noise(capsys):
    result = _compare(
        capsys, str(TRACES / "fragment.jsonl.gz"), str(TRACES / "fragment-expandable.jsonl.gz")
    )
    reserved = _diff(result, "reserved at most")
    assert reserved["beyond_noise"] and reserved["difference"] < -(1 << 30)
    assert not _diff(result, "step time median")["beyond_noise"]  # the same model and batch
    assert "reserved at most 2.3 GiB less" in result["verdict"]


def test_a_smaller_model_is_named_smaller_and_faster(capsys):
    result = _compare(capsys, str(TRACES / "healthy.jsonl.gz"), str(TRACES / "hf-trainer.jsonl.gz"))
    assert _diff(result, "peak")["beyond_noise"] and _diff(result, "peak")["difference"] < 0
    step = _diff(result, "step time median")
    assert step["beyond_noise"] and step["relative"] < -0.3
    assert result["a"]["step_times"] > 100 and "faster" in result["verdict"]


def test_a_run_against_itself_differs_in_nothing(capsys):
    trace = str(TRACES / "leak.jsonl.gz")
    result = _compare(capsys, trace, trace)
    assert result["verdict"] == "no difference beyond noise"
    assert all(d["difference"] in (0, None) for d in result["differences"])


def test_a_recording_of_several_processes_asks_which(tmp_path: Path, capsys):
    assert main(["compare", str(TRACES), str(TRACES / "leak.jsonl.gz")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("memtop: A: 6 processes (426, 427, 430") and "(--a-pid)" in err
    result = _compare(capsys, str(TRACES), str(TRACES / "leak.jsonl.gz"), "--a-pid", "427")
    assert result["a"]["pid"] == 427 and result["verdict"] == "no difference beyond noise"


@pytest.mark.slow
def test_two_live_trainers_of_one_setup_differ_in_nothing_beyond_noise(socket_dir: Path):
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir))
    demo = subprocess.Popen(
        [sys.executable, "-m", "memtop", "demo", "--no-ui", "--scenario", "healthy", "--gpus", "2"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert demo.stdout is not None
        banner = demo.stdout.readline()
        pids = re.search(r"pids ([\d ]+)\.", banner).group(1).split()  # type: ignore[union-attr]
        time.sleep(3)
        done = subprocess.run(
            [sys.executable, "-m", "memtop", "compare", *pids, "--seconds", "4", "--json"],
            env=env, capture_output=True, text=True, timeout=90,
        )  # fmt: skip
    finally:
        demo.terminate()
        demo.wait(15)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    beyond = [d["figure"] for d in result["differences"] if d["beyond_noise"]]
    assert result["verdict"] == "no difference beyond noise", beyond
    assert result["a"]["step_times"] >= 5 and result["b"]["pid"] == int(pids[1])
