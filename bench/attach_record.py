"""Figures for `memtop run`, `memtop attach`, `memtop record` and `memtop replay` (issue 13).

    nice .venv/bin/python bench/attach_record.py

Prints: start-up of `memtop run hello.py` beside python's own (and beside importing torch, what
`memtop run` used to cost); `memtop attach` wall time and time to the first counted step of a
plain CPU trainer; record size per minute for `memtop demo --scenario mixed` (4 trainers, 2 GPUs);
replay --once wall time on the H100 recordings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from memtop.base import children  # noqa: E402

PY = sys.executable
MEMTOP = children.python_command("memtop")  # isolated from the current directory


def best_of(args: list[str], n: int = 5, cwd: Path | None = None, env: dict | None = None) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(args, cwd=cwd, env=env, capture_output=True, check=True)
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="mt-bench-"))
    sockets = work / "s"
    sockets.mkdir(mode=0o700)
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(sockets))
    (work / "hello.py").write_text("print('hello')\n")

    python = best_of([PY, "hello.py"], cwd=work, env=env)
    run = best_of([*MEMTOP, "run", "hello.py"], cwd=work, env=env)
    torch_import = best_of([PY, "-c", "import torch"], n=3, cwd=work, env=env)
    print(f"python hello.py            {python * 1000:7.0f} ms")
    print(f"memtop run hello.py        {run * 1000:7.0f} ms  (+{(run - python) * 1000:.0f} ms)")
    print(f"python -c 'import torch'   {torch_import * 1000:7.0f} ms  (what run paid before)")

    trainer, _ = children.start_until_first_line(
        [PY, "examples/train_cpu.py", "--step-time", "0.01", "--device", "cpu"], env, ROOT
    )
    t = time.perf_counter()
    subprocess.run([*MEMTOP, "attach", str(trainer.pid)], env=env, check=True, capture_output=True)
    attach_s = time.perf_counter() - t
    step = None
    while not step:
        out = subprocess.run([*MEMTOP, "--once", "--json"], env=env, capture_output=True, text=True)
        agents = json.loads(out.stdout)["agents"]
        step = agents[0]["step"] if agents else None
    first_step_s = time.perf_counter() - t
    trainer.kill()
    trainer.wait()
    print(
        f"memtop attach (gdb)        {attach_s * 1000:7.0f} ms; first step in --once after "
        f"{first_step_s:.1f} s"
    )

    demo, _ = children.start_until_first_line(
        [*MEMTOP, "demo", "--no-ui", "--scenario", "mixed"], env
    )
    out = work / "run.memtop"
    seconds = 20
    subprocess.run(
        [*MEMTOP, "record", "-o", str(out), "--seconds", str(seconds)],
        env=env,
        check=True,
        capture_output=True,
    )
    demo.send_signal(signal.SIGTERM)
    demo.wait()
    size = out.stat().st_size
    print(
        f"memtop record, demo mixed  {size / 1024:7.1f} KiB for {seconds} s = "
        f"{size / 1024 / seconds * 60:.0f} KiB/min (4 trainers, 2 GPUs, 1 s interval)"
    )

    for target in (ROOT / "tests/data/traces/leak.jsonl.gz", ROOT / "tests/data/traces", out):
        took = best_of([*MEMTOP, "replay", str(target), "--once", "--json"], n=3, env=env)
        print(f"memtop replay --once       {took * 1000:7.0f} ms  {target.name}")


if __name__ == "__main__":
    # Ctrl-C, SIGTERM (`timeout`) and SIGHUP unwind main: what it started is stopped.
    sys.exit(children.run_stopping_children(main))
