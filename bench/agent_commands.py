"""What each agent command costs the trainer, command by command (the ceilings in docs/agent.md).

    .venv/bin/python bench/agent_commands.py [--device cpu|cuda] [--seconds 4]

A real training loop (MLP, AdamW, `zero_grad(set_to_none=True)`) runs on this process's main
thread with the agent started as `memtop run` starts it; a viewer in another process (no torch,
like memtop) sends one kind of command at a time.  For each command it prints:

- the viewer's round trip (median);
- the agent thread's CPU per request (from /proc/self/task/<tid>/schedstat), which is what the
  trainer can lose to the GIL;
- the trainer's own time spent at step boundaries on the command's behalf (the agent's
  `boundary_work_ns`, and the `took_s` the reply reports): that is where tensors are touched.

The last line is JSON.
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
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent_overhead import thread_cpu_s  # one reader of a thread's CPU clock

from memtop.base import children

PLAN = (  # command, requests, pause between (s): the pauses respect the agent's cooldowns
    ("sample", 200, 0.02),
    ("reset_peak", 50, 0.05),
    ("breakdown", 3, 10.5),
    ("snapshot", 2, 6.0),
    ("cleanup", 2, 0.0),
)


def viewer_main(pid: int, directory: Path, out: Path, plan: list[list[Any]]) -> int:
    from memtop.sources.agents import AgentClient, AgentError

    children.die_with_parent(os.getppid(), lambda: os._exit(1))  # a bench stopped by KILL
    client = AgentClient(pid, directory, timeout=30)
    client.connect()
    results: dict[str, Any] = {}
    for cmd, count, pause in plan:
        print(f"begin {cmd}", flush=True)
        sys.stdin.readline()  # the trainer has read the agent thread's CPU clock
        rtts, took, refused = [], [], 0
        for i in range(count):
            args: dict[str, Any] | None = None
            if cmd == "snapshot":
                args = {"path": str(out / f"snap{i}.pickle"), "wait_s": 10}
            elif cmd == "cleanup" or cmd == "breakdown":
                args = {"wait_s": 10}
            started = time.perf_counter()
            try:
                reply = client.request(cmd, args, timeout=30)
            except AgentError as exc:
                refused += 1
                print(f"  {cmd}: {exc}", file=sys.stderr)
                time.sleep(pause)
                continue
            rtts.append(time.perf_counter() - started)
            if isinstance(reply, dict) and isinstance(reply.get("took_s"), int | float):
                took.append(reply["took_s"])
            time.sleep(pause)
        results[cmd] = {"rtts": rtts, "took": took, "refused": refused}
    print("end", flush=True)
    sys.stdin.readline()
    client.close()
    print(json.dumps(results), flush=True)
    return 0


def trainer_main(args: argparse.Namespace) -> int:
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

    import memtop.agent
    from memtop.agent.torch_probe import TorchProbe

    torch.set_num_threads(1)
    device = torch.device(args.device)
    layers: list[Any] = []
    for _ in range(4):
        layers += [torch.nn.Linear(512, 512), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(64, 512, device=device)
    socket_dir = Path(tempfile.mkdtemp(prefix="mt-cmds-"))
    agent = memtop.agent.start_agent(probe=TorchProbe(), socket_dir=socket_dir)
    assert agent is not None and agent._thread is not None
    agent_tid = agent._thread.native_id
    viewer = subprocess.Popen(
        [sys.executable, __file__, "--viewer", str(os.getpid()), str(socket_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, MEMTOP_PLAN=json.dumps(PLAN)),
    )
    assert viewer.stdin is not None and viewer.stdout is not None
    lines: list[str] = []
    stop = threading.Event()

    def read_viewer() -> None:
        assert viewer.stdout is not None
        for line in viewer.stdout:
            lines.append(line)
        stop.set()

    threading.Thread(target=read_viewer, daemon=True).start()
    phases: dict[str, dict[str, float]] = {}
    current: str | None = None
    mark: tuple[float, int, float] = (0.0, 0, 0.0)
    seen = 0
    steps = 0
    while not stop.is_set():
        optimizer.zero_grad(set_to_none=True)
        model(batch).square().mean().backward()
        optimizer.step()
        steps += 1
        while seen < len(lines):
            line = lines[seen].strip()
            seen += 1
            if not (line.startswith("begin") or line == "end"):
                continue
            now = (thread_cpu_s(agent_tid), agent.boundary.work_ns, time.perf_counter())
            if current is not None:
                phases[current] = {
                    "agent_thread_cpu_s": now[0] - mark[0],
                    "boundary_work_s": (now[1] - mark[1]) / 1e9,
                    "wall_s": now[2] - mark[2],
                }
            current = line.split()[1] if line.startswith("begin") else None
            mark = now
            viewer.stdin.write("go\n")
            viewer.stdin.flush()
    viewer.wait(timeout=30)
    result = json.loads(lines[-1])
    costs = agent.boundary.costs()
    memtop.agent.stop_agent()
    report: dict[str, Any] = {"device": args.device, "torch": torch.__version__, "commands": {}}
    for cmd, _count, _ in PLAN:
        got = result[cmd]
        served = len(got["rtts"])
        phase = phases.get(cmd, {})
        report["commands"][cmd] = {
            "served": served,
            "refused": got["refused"],
            "rtt_ms_median": round(1000 * statistics.median(got["rtts"]), 3) if served else None,
            "agent_thread_us_per_request": round(
                1e6 * phase.get("agent_thread_cpu_s", 0.0) / max(1, served), 1
            ),
            "trainer_ms_per_request": round(1000 * statistics.median(got["took"]), 3)
            if got["took"]
            else round(1000 * phase.get("boundary_work_s", 0.0) / max(1, served), 3),
        }
    # hook_ns includes the boundary work (the commands' own cost, above): the hook alone is
    # the rest, amortised over every step.
    hook_only = costs["hook_ns"] - costs["boundary_work_ns"]
    report["hook_ns_per_step"] = round(hook_only / max(1, costs["hook_calls"]), 1)
    report["steps"] = steps
    print(f"torch {torch.__version__} on {args.device}; {steps} training steps")
    print(f"{'command':<12}{'served':>7}{'round trip':>13}{'agent thread':>15}{'trainer':>12}")
    for cmd, row in report["commands"].items():
        rtt = f"{row['rtt_ms_median']:.3f} ms" if row["rtt_ms_median"] is not None else "-"
        print(
            f"{cmd:<12}{row['served']:>7}{rtt:>13}"
            f"{row['agent_thread_us_per_request']:>12.1f} us"
            f"{row['trainer_ms_per_request']:>9.3f} ms"
        )
    print(f"step hook: {report['hook_ns_per_step'] / 1000:.2f} us per step (amortised)")
    print(json.dumps(report))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--viewer", nargs=2, metavar=("PID", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.viewer:
        with tempfile.TemporaryDirectory() as out:
            plan = json.loads(os.environ["MEMTOP_PLAN"])
            return viewer_main(int(args.viewer[0]), Path(args.viewer[1]), Path(out), plan)
    return trainer_main(args)


if __name__ == "__main__":
    # Ctrl-C, SIGTERM (`timeout`) and SIGHUP unwind main: what it started is stopped.
    sys.exit(children.run_stopping_children(main))
