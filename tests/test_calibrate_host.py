"""Calibrated by a CPU run: a trainer without a CUDA device reports its host memory (issue 24.3).

torch 2.13 keeps no CPU memory counters, so the agent reports the process's resident set (its
high-water mark from the kernel) and, at step marks, the resident set right after a step less
what glibc keeps free; `memtop estimate --from PID|RECORDING` fits on those.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from memtop import protocol
from memtop.cli import main
from memtop.figures.units import MiB

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "estimate_cpu.py"


def cpu_agent(socket_dir: Path):  # type: ignore[no-untyped-def]
    """A real agent over a probe with no device: a CPU trainer, as the agent sees one."""
    from memtop.agent.server import Agent
    from memtop.sim.probe import SimulatedProbe

    agent = Agent(SimulatedProbe([]), socket_dir, argv=["train_cpu.py"])
    agent.start()
    return agent


def ask(pid: int, directory: Path, cmd: str, args: dict | None = None) -> dict:
    sock = protocol.connect(pid, directory, timeout=10.0)
    try:
        request: dict = {"id": 1, "cmd": cmd}
        if args:
            request["args"] = args
        protocol.send_message(sock, request)
        return dict(protocol.recv_message(sock)["result"])
    finally:
        sock.close()


def test_a_cpu_trainers_sample_reports_its_host_memory(socket_dir):
    """The `host_memory` block and the step marks' host figures, in rows and in columns, as the
    viewer parses them; a step that touches 64 MiB shows in the high-water mark."""
    agent = cpu_agent(socket_dir)
    try:
        before = ask(os.getpid(), socket_dir, "sample")["host_memory"]
        for _ in range(3):
            block = bytearray(64 * MiB)  # a step's transient, touched (calloc'd pages)
            block[::4096] = b"x" * len(block[::4096])
            del block
            agent.on_step(explicit=True)
            agent.boundary._mark_due = 0.0  # every step marked (the rate limit is 20 a second)
        rows = ask(os.getpid(), socket_dir, "sample")
        columns = ask(os.getpid(), socket_dir, "sample", {"mark_layout": "columns"})
    finally:
        agent.stop()
    host = rows["host_memory"]
    assert 0 < host["rss_bytes"] <= host["peak_rss_bytes"] <= host["total_bytes"]
    assert host["peak_rss_bytes"] >= before["rss_bytes"] + 60 * MiB
    parsed = protocol.parse_sample(rows)
    assert parsed.devices == ()
    assert parsed.host_memory is not None
    assert parsed.host_memory.peak_rss_bytes == host["peak_rss_bytes"]
    marks = parsed.step_marks
    assert len(marks) == 3 and all(m.host_rss for m in marks)
    # glibc's free bytes: in the first mark (then at most once a second: ~40 µs a read).
    assert marks[0].host_heap_free is not None
    assert marks[0].host_in_use is not None and marks[0].host_in_use <= marks[0].host_rss
    from_columns = protocol.parse_sample(columns).step_marks
    assert [m.host_rss for m in from_columns] == [m.host_rss for m in marks]
    assert from_columns[0].host_heap_free == marks[0].host_heap_free


def test_the_viewer_accepts_agents_without_host_memory_and_refuses_bad_figures():
    plain = {
        "time": 1.0,
        "step": 3,
        "devices": [],
        "step_marks": [{"step": 3, "time": 1.0, "allocated_bytes": {}}],
    }
    parsed = protocol.parse_sample(plain)
    assert parsed.host_memory is None and parsed.step_marks[0].host_rss is None
    assert parsed.step_marks[0].host_in_use is None
    good = {"rss_bytes": 10, "peak_rss_bytes": 20, "total_bytes": 100}
    assert protocol.parse_sample({**plain, "host_memory": good}).host_memory is not None
    for bad in (
        {"host_memory": "node-3"},
        {"host_memory": {**good, "rss_bytes": -1}},
        {"host_memory": {**good, "peak_rss_bytes": 1.5}},
        {"host_memory": {**good, "total_bytes": True}},
        {"step_marks": [{"step": 3, "time": 1.0, "allocated_bytes": {}, "host_rss_bytes": -5}]},
        {
            "step_marks": [
                {"step": 3, "time": 1.0, "allocated_bytes": {}, "host_heap_free_bytes": "x"}
            ]
        },
        {
            "step_marks": [],
            "step_mark_columns": {
                "step": [3],
                "time": [1.0],
                "allocated_bytes": {},
                "host_rss_bytes": [],
            },
        },
    ):
        with pytest.raises(protocol.ProtocolError):
            protocol.parse_sample({**plain, **bad})


def test_estimate_from_a_live_cpu_trainer_calibrates_on_host_memory(
    capsys, socket_dir, monkeypatch
):
    """`--from PID` of a trainer with no CUDA device: measured by its host memory (labelled so,
    never as a GPU), fixed part from the step marks, fitted to the machine's memory."""
    monkeypatch.setenv("MEMTOP_SOCKET_DIR", str(socket_dir))
    agent = cpu_agent(socket_dir)
    stop = threading.Event()

    def train() -> None:
        while not stop.is_set():
            block = bytearray(8 * MiB)
            block[::4096] = b"x" * len(block[::4096])
            del block
            agent.on_step(explicit=True)
            stop.wait(0.01)

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        while agent.step is None or agent.step < 5:
            stop.wait(0.01)
        assert (
            main(
                [
                    "estimate",
                    "--from",
                    str(os.getpid()),
                    "--measured-batch",
                    "4",
                    "--batch",
                    "8",
                    "--json",
                ]
            )
            == 0
        )
        out = json.loads(capsys.readouterr().out)
        assert main(["estimate", "--from", str(os.getpid()), "--measured-batch", "4"]) == 0
        text = capsys.readouterr().out
    finally:
        stop.set()
        trainer.join(10)
        agent.stop()
    cal = out["calibration"]
    measured = cal["measured"]
    assert measured["memory"] == "host" and measured["device"] == -1
    assert measured["peak_bytes"] > 0 and measured["steps"] >= 1  # marks: at most 20 a second
    assert 0 < cal["fixed_bytes"] <= measured["peak_bytes"]
    assert cal["peak_bytes"] >= measured["peak_bytes"]  # batch 8 needs at least batch 4's
    assert out["total_bytes"] == cal["reserved_bytes"] == cal["peak_bytes"]  # no CUDA context
    assert out["targets"][0]["source"] == "host"
    assert out["targets"][0]["total_bytes"] == measured["device_total_bytes"] > 0
    assert "host memory" in text and "GPU" not in text


def test_estimate_from_a_recording_of_a_cpu_trainer(capsys, tmp_path):
    """A wire recording (shared/traces' shape) of a CPU trainer: the host figures of its
    samples, the lowest resident set less glibc's free bytes as the fixed part."""
    samples = []
    for step in range(1, 6):
        samples.append(
            {
                "t": float(step),
                "cmd": "sample",
                "reply": {
                    "id": step,
                    "result": {
                        "time": float(step),
                        "step": step,
                        "devices": [],
                        "host_memory": {
                            "rss_bytes": 400 * MiB,
                            "peak_rss_bytes": 420 * MiB,
                            "total_bytes": 8192 * MiB,
                        },
                        "step_marks": [
                            {
                                "step": step,
                                "time": float(step),
                                "allocated_bytes": {},
                                "host_rss_bytes": 410 * MiB,
                                "host_heap_free_bytes": 20 * MiB if step == 2 else None,
                            }
                        ],
                    },
                },
            }
        )
    hello = {
        "t": 0.0,
        "cmd": "hello",
        "reply": {
            "id": 0,
            "result": {
                "protocol": 1,
                "pid": 4242,
                "argv": ["train_cpu.py"],
                "python": "3.11",
                "torch": "2.13",
                "allocator_conf": "",
                "devices": [],
            },
        },
    }
    path = tmp_path / "cpu.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for line in [hello, *samples]:
            f.write(json.dumps(line) + "\n")
    assert (
        main(["estimate", "--from", str(path), "--measured-batch", "4", "--batch", "8", "--json"])
        == 0
    )
    cal = json.loads(capsys.readouterr().out)["calibration"]
    assert cal["measured"]["memory"] == "host"
    assert cal["fixed_bytes"] == 390 * MiB  # 410 resident less 20 free in glibc's heap
    assert cal["peak_bytes"] == 390 * MiB + 2 * 30 * MiB


@pytest.mark.slow
def test_cpu_example_batch_peak_predicted_within_5_percent():
    """The issue's goal at a smaller scale: examples/train_cpu.py run under the agent at two
    batches at once, the peak of the larger predicted from the smaller within ±5 %, as the
    bench measures it.  Batch 512 → 1024 rather than the issue's 4 → 8: at 4 → 8 the batch is
    0.1 % of the process and any fit passes; here the part that grows is ~5 % of the peak.
    Measured (3 runs each, loaded 2-core box): 512 → 1024 +0.98, +0.59, +0.29 %; 1024 → 2048
    +1.42, -0.38, -0.01 %; 4 → 8 +0.74, +1.03, +0.54 %.  The spread comes from the processes,
    not the fit (two trainers at one batch differ by ~2 MiB of ~340), so ±5 % holds with room."""
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--runs",
            "1",
            "--steps",
            "40",
            "--measured-batch",
            "512",
            "--batch",
            "1024",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    run = json.loads(out.stdout.strip().splitlines()[-1])["runs"][0]
    assert abs(run["error_pct"]) <= 5.0, run
    assert run["actual_peak_bytes"] > run["measured_peak_bytes"]
