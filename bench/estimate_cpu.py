"""Calibrated estimate on a CPU trainer: predicted peak at one batch from a run at another.

    .venv/bin/python bench/estimate_cpu.py [--measured-batch 4] [--batch 8] [--width 256]
                                           [--steps 200] [--runs 3] [--json]

What it runs, per run: examples/train_cpu.py under `memtop run` twice at once, at
`--measured-batch` and at `--batch` (CPU, no CUDA device: the agent reports the process's host
memory, memtop.agent.host_memory).  Once both have stepped `--steps` times it asks
`memtop estimate --from PID --measured-batch M --batch B --json` about the first (the real CLI,
over the agent's socket), and the second's agent for its own peak, the same figure the estimate
calibrates on (the kernel's high-water mark of the resident set, VmHWM).  From outside, a reader
thread also polls each trainer's /proc/<pid>/statm at ~1 kHz: the densest resident set reading
a sampler could take, and the agent's own `rss_bytes` at the 2 Hz the bench polls it: how
much a sampled maximum misses of the peak.

What it prints, per run and then as JSON: predicted and measured peak, the error in % of the
measured peak, and in % of the part that grows with the batch (measured peak minus the fitted
fixed part: the honest figure when the batch's share of the process is small), and the CPU cost
of each host memory reading.  Every trainer is stopped on exit (memtop.base.children), also on
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from memtop import protocol  # noqa: E402
from memtop.base import children  # noqa: E402

MiB = 1 << 20
START_TIMEOUT_S = 120.0  # torch's import on a loaded 2-core box takes tens of seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured-batch", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200, help="steps before measuring")
    parser.add_argument("--step-time", type=float, default=0.002, help="sleep per step, s")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print only the JSON")
    return parser.parse_args(argv)


class DenseReader:
    """Polls /proc/<pid>/statm from outside the trainer: the largest resident set seen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.max_rss = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        path = f"/proc/{self.pid}/statm"
        while not self._stop.is_set():
            try:
                with open(path, "rb") as f:
                    rss = int(f.read(256).split()[1]) * self._page
            except (OSError, IndexError, ValueError):
                return
            self.max_rss = max(self.max_rss, rss)
            time.sleep(0.001)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)


def start_trainer(batch: int, width: int, step_time: float, env: dict[str, str]) -> Any:
    return subprocess.Popen(
        children.python_command(
            "memtop",
            "run",
            str(ROOT / "examples" / "train_cpu.py"),
            "--device",
            "cpu",
            "--batch-size",
            str(batch),
            "--width",
            str(width),
            "--step-time",
            str(step_time),
        ),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # A bench killed mid-run (a test's timeout) must not leave a trainer stepping for good.
        preexec_fn=children.signalled_when_parent_dies(),
    )


def sample(pid: int, directory: Path) -> dict[str, Any]:
    sock = protocol.connect(pid, directory, timeout=10.0)
    try:
        protocol.send_message(sock, {"id": 1, "cmd": "sample"})
        reply = protocol.recv_message(sock)
    finally:
        sock.close()
    return dict(reply["result"])


def wait_for_steps(
    pid: int, directory: Path, steps: int, process: Any, sampled: dict[int, int]
) -> dict[str, Any]:
    """Polls the agent at 2 Hz (a dashboard's rate) until `steps`; `sampled[pid]` keeps the
    largest resident set those samples saw: what a viewer's own maximum would be."""
    deadline = time.monotonic() + START_TIMEOUT_S + steps
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"trainer {pid} exited: {process.stderr.read()[-2000:]}")
        if protocol.socket_path(pid, directory).exists():
            try:
                result = sample(pid, directory)
            except (OSError, protocol.ProtocolError, protocol.ConnectionClosed):
                result = {}
            host = result.get("host_memory") or {}
            sampled[pid] = max(sampled.get(pid, 0), int(host.get("rss_bytes") or 0))
            if (result.get("step") or 0) >= steps:
                return result
        time.sleep(0.5)
    raise SystemExit(f"trainer {pid} did not reach step {steps} in time")


def one_run(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    env = {**os.environ, "MEMTOP_SOCKET_DIR": str(directory), "CUDA_VISIBLE_DEVICES": ""}
    measured = start_trainer(args.measured_batch, args.width, args.step_time, env)
    target = start_trainer(args.batch, args.width, args.step_time, env)
    readers = [DenseReader(measured.pid), DenseReader(target.pid)]
    try:
        sampled: dict[int, int] = {}
        wait_for_steps(measured.pid, directory, args.steps, measured, sampled)
        wait_for_steps(target.pid, directory, args.steps, target, sampled)
        estimate = subprocess.run(
            children.python_command(
                "memtop",
                "estimate",
                "--from",
                str(measured.pid),
                "--measured-batch",
                str(args.measured_batch),
                "--batch",
                str(args.batch),
                "--json",
            ),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if estimate.returncode != 0:
            raise SystemExit(f"memtop estimate failed: {estimate.stderr.strip()}")
        result = json.loads(estimate.stdout)
        truth = protocol.parse_sample(sample(target.pid, directory))
        source = protocol.parse_sample(sample(measured.pid, directory))
    finally:
        for reader in readers:
            reader.stop()
        children.stop_all([measured, target])
    assert truth.host_memory is not None and source.host_memory is not None
    cal = result["calibration"]
    predicted = int(cal["peak_bytes"])
    actual = truth.host_memory.peak_rss_bytes
    growing = actual - int(cal["fixed_bytes"])
    return {
        "measured_batch": args.measured_batch,
        "batch": args.batch,
        "width": args.width,
        "measured_peak_bytes": source.host_memory.peak_rss_bytes,
        "measured_dense_max_bytes": readers[0].max_rss,
        "fixed_bytes": int(cal["fixed_bytes"]),
        "activation_bytes_per_sample": cal["activation_bytes_per_sample"],
        "predicted_peak_bytes": predicted,
        "actual_peak_bytes": actual,
        "actual_dense_max_bytes": readers[1].max_rss,
        "actual_sampled_max_bytes": sampled.get(target.pid, 0),
        "actual_baseline_bytes": min(
            (m.host_rss for m in truth.step_marks if m.host_rss is not None), default=None
        ),
        "error_pct": 100.0 * (predicted - actual) / actual,
        "error_of_growing_pct": 100.0 * (predicted - actual) / growing if growing > 0 else None,
    }


def reading_costs(repeat: int = 2000) -> dict[str, float]:
    """CPU µs per call of each host memory reading, in this process (the agent runs the same
    code in the trainer's): thread CPU time, not wall, so a loaded box does not inflate it."""
    from memtop.agent.host_memory import HostMemory

    host = HostMemory()
    costs = {}
    for name, call in (
        ("sample_host_memory_us", host.reading),  # the agent's thread, per `sample`
        ("step_mark_rss_us", host.rss_bytes),  # the trainer's thread, per step mark (<= 20/s)
        ("step_mark_heap_free_us", host.heap_free_bytes),  # the trainer's thread, <= 1/s
    ):
        best = float("inf")
        for _ in range(5):
            started = time.thread_time_ns()
            for _ in range(repeat):
                call()
            best = min(best, (time.thread_time_ns() - started) / repeat / 1000)
        costs[name] = round(best, 2)
    return costs


def main() -> int:
    args = parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="memtop-est-") as tmp:
        directory = Path(tmp) / "sock"
        directory.mkdir(mode=0o700)
        for run in range(args.runs):
            row = one_run(args, directory)
            runs.append(row)
            if not args.json:
                print(
                    f"run {run + 1}: batch {args.measured_batch} → {args.batch} (width "
                    f"{args.width}): predicted {row['predicted_peak_bytes'] / MiB:.2f} MiB, "
                    f"measured {row['actual_peak_bytes'] / MiB:.2f} MiB (dense max "
                    f"{row['actual_dense_max_bytes'] / MiB:.2f}, 2 Hz samples' max "
                    f"{row['actual_sampled_max_bytes'] / MiB:.2f}), error {row['error_pct']:+.2f} %"
                    + (
                        f" ({row['error_of_growing_pct']:+.1f} % of the part that grows)"
                        if row["error_of_growing_pct"] is not None
                        else ""
                    ),
                    flush=True,
                )
    errors = [r["error_pct"] for r in runs]
    summary = {
        "runs": runs,
        "error_pct_max_abs": max(abs(e) for e in errors),
        "error_pct_mean": statistics.fmean(errors),
        "reading_costs": reading_costs(),
    }
    print(json.dumps(summary, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(children.run_stopping_children(main))
