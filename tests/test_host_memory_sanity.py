"""Impossible host memory is refused like any other number that cannot be true (issue 36,
item 9): an agent saying 2^62 bytes resident on a 1-byte machine, or a machine of 2^62 bytes,
was shown (and calibrated on) as if it were so.  Real hostile agents (tests/hostile_agent.py)
and the real command line."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from memtop.cli import main
from memtop.model import HostMemory
from memtop.sources.agent_sanity import host_memory_problem

HOSTILE = str(Path(__file__).with_name("hostile_agent.py"))
GiB = 1 << 30


@pytest.fixture
def liars(socket_dir: Path) -> Iterator[dict[str, int]]:
    processes = {}
    try:
        for kind in ("hugehost", "bighost"):
            process = subprocess.Popen(
                [sys.executable, HOSTILE, kind, str(socket_dir)], stdout=subprocess.PIPE, text=True
            )
            processes[kind] = process
            assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        yield {kind: p.pid for kind, p in processes.items()}
    finally:
        for process in processes.values():
            process.kill()
            process.wait()


def test_the_viewer_marks_impossible_host_memory_inconsistent(
    liars: dict[str, int], socket_dir: Path
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "memtop.cli", "--once", "--json"],
        capture_output=True, text=True, timeout=60,
        env=dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir)),
    )  # fmt: skip
    agents = {a["pid"]: a for a in json.loads(result.stdout)["agents"]}
    huge, big = agents[liars["hugehost"]], agents[liars["bighost"]]
    assert huge["state"] == "inconsistent", huge
    assert f"high-water mark {2**62} > the machine's 1 bytes" in huge["error"]
    assert big["state"] == "inconsistent", big
    assert f"claims {2**62} bytes on a machine of" in big["error"]
    assert huge["devices"] == [] and big["devices"] == []  # none of their numbers kept


def test_the_rules() -> None:
    assert host_memory_problem(HostMemory(GiB, 2 * GiB, 8 * GiB), 8 * GiB) is None
    assert host_memory_problem(HostMemory(GiB, 2 * GiB, None), None) is None
    assert "resident" in (host_memory_problem(HostMemory(2 * GiB, GiB, None), None) or "")
    assert "high-water" in (host_memory_problem(HostMemory(GiB, 2**62, 1), None) or "")
    # A container's MemTotal may be below the machine's, never above it.
    assert host_memory_problem(HostMemory(GiB, GiB, 4 * GiB), 8 * GiB) is None
    assert "claims" in (host_memory_problem(HostMemory(GiB, GiB, 2**62), 8 * GiB) or "")


def test_estimate_refuses_a_recording_of_impossible_host_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hello = {
        "t": 0.0,
        "cmd": "hello",
        "reply": {
            "id": 0,
            "result": {
                "protocol": 1, "pid": 4242, "argv": ["train_cpu.py"], "python": "3.11",
                "torch": "2.13", "allocator_conf": "", "devices": [],
            },
        },
    }  # fmt: skip
    samples = [
        {
            "t": float(step),
            "cmd": "sample",
            "reply": {
                "id": step,
                "result": {
                    "time": float(step),
                    "step": step,
                    "devices": [],
                    "host_memory": {"rss_bytes": 2**62, "peak_rss_bytes": 2**62, "total_bytes": 1},
                    "step_marks": [],
                },
            },
        }
        for step in range(1, 4)
    ]
    path = tmp_path / "cpu.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for line in [hello, *samples]:
            f.write(json.dumps(line) + "\n")
    code = main(["estimate", "--from", str(path), "--measured-batch", "4", "--batch", "8"])
    err = capsys.readouterr().err
    assert code != 0 and "cannot be true" in err and err.count("\n") == 1, (code, err)
