"""CPU seconds and peak memory of `memtop replay --once [--json]`, of two trees side by side.

Each tree's memtop runs as its own process (`python -m memtop replay ... --once`, the tree as
the working directory, so `python -m` imports that tree), under `/usr/bin/time`: user + sys
CPU seconds and the peak resident set (%M).  The trees' runs are interleaved (A B A B ...) so
that both see the same load on a shared box; the load average is printed beside the figures.

Recordings: tests/data/traces (six agent wire recordings, 9.7 MB decompressed) and two long
ones made here from the leak trace: an agent wire recording and a `memtop record` file (driver
readings, process lists and the agent's replies), `--mb` MB decompressed each.

    python bench/replay_cost.py --old /work/wt/main-base [--new .] [--runs 3] [--mb 40]
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from memtop.model import DeviceReading, DriverReading
from memtop.sources.processes import ProcessInfo
from memtop.sources.recording import RecordWriter

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "tests" / "data" / "traces"
PID = 4242


def _trace_lines() -> list[dict]:
    raw = gzip.decompress((TRACES / "leak.jsonl.gz").read_bytes())
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def long_wire(path: Path, megabytes: int) -> None:
    """The leak trace's replies played again and again, each round later by the trace's span."""
    hello, *rest = _trace_lines()
    span = rest[-1]["t"] - hello["t"] + 1.0
    out = [json.dumps(hello)]
    size, round_ = 0, 0
    while size < megabytes << 20:
        for line in rest:
            line = {**line, "t": line["t"] + round_ * span}
            text = json.dumps(line)
            out.append(text)
            size += len(text) + 1
        round_ += 1
    path.write_bytes(gzip.compress(("\n".join(out) + "\n").encode(), 6))


def long_record(path: Path, megabytes: int) -> None:
    """A record file: per agent reply of the leak trace, a driver reading and a process list."""
    hello, *rest = _trace_lines()
    span = rest[-1]["t"] - hello["t"] + 1.0
    writer = RecordWriter(path, overwrite=True)
    device = DeviceReading(0, "GPU-bench", "H100", 80 << 30, 2 << 30, power_watts=300.0)
    reading = dataclasses.asdict(DriverReading(True, (device,)))
    info = dataclasses.asdict(ProcessInfo(PID, 1000, "me", ("train.py",), "python", hello["t"]))
    t0 = hello["t"]
    writer.write({"t": t0, "src": "agent", "pid": PID, "cmd": "hello", "reply": hello["reply"]})
    size, round_ = 0, 0
    while size < megabytes << 20:
        for line in rest:
            if "cmd" not in line:
                continue
            t = line["t"] + round_ * span
            reply = {"result": line["reply"].get("result")}
            for written in (
                {"t": t, "src": "nvml", "reading": reading},
                {"t": t, "src": "processes", "processes": [info]},
                {"t": t, "src": "agent", "pid": PID, "cmd": line["cmd"], "reply": reply},
            ):
                writer.write(written)
                size += len(json.dumps(written)) + 1
        round_ += 1
    writer.close()


def measure(tree: Path, recording: Path, mode: list[str]) -> tuple[float, int]:
    """CPU seconds (user + sys) and peak RSS in KiB of one `memtop replay --once` in `tree`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = ["/usr/bin/time", "-f", "%U %S %M", sys.executable, "-m", "memtop", "replay"]
    done = subprocess.run(
        [*command, str(recording), "--once", *mode],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    user, system, peak = done.stderr.strip().splitlines()[-1].split()
    return float(user) + float(system), int(peak)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="the tree to compare with")
    parser.add_argument("--new", type=Path, default=ROOT, help="default: this tree")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mb", type=int, default=40, help="size of the long recordings")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wire, record = Path(tmp) / "long.jsonl.gz", Path(tmp) / "long.memtop"
        long_wire(wire, args.mb)
        long_record(record, args.mb)
        for made in (wire, record):
            size = len(gzip.decompress(made.read_bytes())) >> 20
            print(f"{made.name}: {made.stat().st_size >> 20} MiB gzip, {size} MiB of lines")
        print("CPU-s: median (min) of the runs; MiB: the largest peak RSS")
        print(f"{'recording':16} {'mode':7} {'old CPU-s':>12} {'new CPU-s':>12} "
              f"{'old MiB':>8} {'new MiB':>8}  load (1 min)")  # fmt: skip
        for recording in (TRACES, wire, record):
            for mode in ([], ["--json"]):
                old: list[tuple[float, int]] = []
                new: list[tuple[float, int]] = []
                loads = []
                for _ in range(args.runs):
                    loads.append(os.getloadavg()[0])
                    old.append(measure(args.old.resolve(), recording, mode))
                    new.append(measure(args.new.resolve(), recording, mode))
                loads.append(os.getloadavg()[0])
                cpu = [
                    f"{statistics.median(c for c, _ in runs):5.2f} ({min(c for c, _ in runs):.2f})"
                    for runs in (old, new)
                ]
                print(
                    f"{recording.name:16} {' '.join(mode) or 'text':7} {cpu[0]:>12} {cpu[1]:>12} "
                    f"{max(p for _, p in old) / 1024:8.1f} {max(p for _, p in new) / 1024:8.1f}"
                    f"  {min(loads):.1f}-{max(loads):.1f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
