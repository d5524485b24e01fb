"""Round trip of one agent `sample` as a viewer sees it (budget: < 2 ms, DESIGN §9).

    .venv/bin/python bench/sample_latency.py [--samples 2000]           # simulated trainer
    .venv/bin/python bench/sample_latency.py --torch                    # real torch CPU trainer

The default trainer is `python -m memtop.sim.trainer` (started through memtop.sim.demo.Demo,
one simulated GPU, scenario "healthy"): the real agent serving a full device entry (torch's
~120 allocator stats) and step marks.  `--torch` runs `memtop run examples/train_cpu.py` on the
CPU instead: the real TorchProbe, but with no CUDA device its samples carry no device entries.

One AgentClient connects, then sends `sample` back to back; each round trip is timed around
`AgentClient.sample()`, i.e. request encoding, the agent's work, the reply and its parsing.
The trainer keeps stepping meanwhile.  The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memtop import protocol  # noqa: E402
from memtop.base import children  # noqa: E402
from memtop.sources.agents import AgentClient  # noqa: E402


def start_sim_trainer(socket_dir: Path, step_time: float) -> tuple[int, Callable[[], None]]:
    from memtop.sim.demo import Demo

    demo = Demo(gpus=1, scenario="healthy", step_time=step_time, socket_dir=socket_dir)
    pid = demo.start()[0]
    if not demo.wait_ready():
        demo.stop()
        raise SystemExit("the simulated trainer did not start")
    return pid, demo.stop


def start_torch_trainer(socket_dir: Path, step_time: float) -> tuple[int, Callable[[], None]]:
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir), OMP_NUM_THREADS="1")
    env["PYTHONWARNINGS"] = "ignore"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = children.python_command("memtop", "run", str(ROOT / "examples" / "train_cpu.py"))
    command += ["--device", "cpu", "--step-time", str(step_time)]
    trainer = subprocess.Popen(
        command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )

    def stop() -> None:
        children.stop(trainer, signal.SIGINT, timeout=10)

    deadline = time.monotonic() + 60
    while not protocol.socket_path(trainer.pid, socket_dir).exists():
        if trainer.poll() is not None or time.monotonic() > deadline:
            stop()
            raise SystemExit("the torch trainer did not start its agent")
        time.sleep(0.05)
    return trainer.pid, stop


def main() -> int:
    parser = argparse.ArgumentParser(description="round trip of one agent `sample`")
    parser.add_argument("--samples", type=int, default=2000, help="round trips to time")
    parser.add_argument("--warmup", type=int, default=50, help="round trips not timed")
    parser.add_argument("--torch", action="store_true", help="a real torch CPU trainer")
    parser.add_argument("--step-time", type=float, default=0.02, help="trainer step pacing (s)")
    args = parser.parse_args()

    socket_dir = Path(tempfile.mkdtemp(prefix="mt-lat-"))
    start = start_torch_trainer if args.torch else start_sim_trainer
    pid, stop = start(socket_dir, args.step_time)
    try:
        with AgentClient(pid, socket_dir, timeout=5.0) as client:
            hello = client.connect()
            deadline = time.monotonic() + 60
            while client.sample().step is None:  # measure a trainer that is stepping
                if time.monotonic() > deadline:
                    raise SystemExit("the trainer never stepped")
                time.sleep(0.05)
            for _ in range(args.warmup):
                client.sample()
            rtts, marks = [], 0
            for _ in range(args.samples):
                started = time.perf_counter()
                sample = client.sample()
                rtts.append(time.perf_counter() - started)
                marks += len(sample.step_marks)
            reply_bytes = len(protocol.encode_frame({"id": 1, "result": client.request("sample")}))
            last_step = sample.step
    finally:
        stop()
        shutil.rmtree(socket_dir, ignore_errors=True)

    rtts_ms = sorted(1000 * r for r in rtts)
    median = statistics.median(rtts_ms)
    p99 = rtts_ms[min(len(rtts_ms) - 1, round(0.99 * (len(rtts_ms) - 1)))]
    trainer = "torch" if args.torch else "sim"
    print(
        f"trainer: {trainer} (pid {pid}, torch {hello.torch}, {len(hello.devices)} device(s)); "
        f"{len(rtts_ms)} samples back to back, reply ~{reply_bytes} bytes"
    )
    print(
        f"round trip: median {median:.3f} ms, p99 {p99:.3f} ms, mean "
        f"{statistics.fmean(rtts_ms):.3f} ms, max {rtts_ms[-1]:.3f} ms"
    )
    print(f"trainer at step {last_step}; step marks received while measuring: {marks}")
    print(
        json.dumps(
            {
                "sample_rtt_ms_median": round(median, 4),
                "sample_rtt_ms_p99": round(p99, 4),
                "sample_rtt_ms_mean": round(statistics.fmean(rtts_ms), 4),
                "sample_rtt_ms_max": round(rtts_ms[-1], 4),
                "samples": len(rtts_ms),
                "trainer": trainer,
                "devices": len(hello.devices),
                "reply_bytes": reply_bytes,
            }
        )
    )
    return 0


if __name__ == "__main__":
    # Ctrl-C, SIGTERM (`timeout`) and SIGHUP unwind main: what it started is stopped.
    sys.exit(children.run_stopping_children(main))
