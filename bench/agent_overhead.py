"""Trainer slowdown from an attached memtop agent sampled at 10 Hz (budget: < 0.5 %, DESIGN §9).

    .venv/bin/python bench/agent_overhead.py [--seconds 40] [--device cpu|cuda]

How it measures, and why this way:
- The trainer is a real torch training loop (an MLP with AdamW, ~10 ms a step on one CPU thread)
  in this process; every step is timed with perf_counter.
- The agent is started once, in-process, with `memtop.agent.start_agent()`, as `memtop run` does.
  A viewer runs in *another process* (this script with `--viewer`; it never imports torch, like
  memtop itself): it connects once with `AgentClient` and, while switched on through a pipe,
  sends `sample` at 10 Hz.
- "with" blocks = the optimizer step post-hook installed (the agent's per-step work on the
  trainer's thread) + the agent thread serving 10 Hz samples.  "without" blocks = hook removed,
  viewer silent.  Both share the idle agent thread (a select() that wakes twice a second) and an
  idle connected socket; that cost is not in the ratio.  Keeping the agent up avoids measuring its
  start and stop (thread, socket, reconnect) at every switch instead.
- Blocks are short (1 s) and alternate in ABBA order (without, with, with, without, ...), so drift
  of the machine cancels rather than favouring one side; the first 0.1 s after each switch is
  dropped on both sides.  `--condition nothing` runs the same schedule with no difference between
  the sides: its ratio is the noise floor of the machine.
- torch.set_num_threads(1): one core for the trainer, the rest for the agent thread and viewer.
- The agent's cost is concentrated in the few steps that overlap a sample, so the *median* step
  (overhead_ratio) barely sees it; the *mean* step (throughput) does.  Both are reported.
- Timing ratios on a shared VM are noisy at the 1 % level, so the cost is also measured directly:
  the step hook is timed on its own, and the CPU time of the agent thread is read from
  /proc/self/task/<tid>/schedstat.  Their sum per second of training is an upper bound on the
  slowdown if the agent's work were fully serialised with the trainer (the GIL), which is what
  `cost_bound_pct` reports.

The last line of output is one JSON object (overhead_ratio = median step with / without).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from memtop.base import children

WARMUP_S = 3.0
SETTLE_S = 0.1


# ---------------------------------------------------------------------------------- viewer


def viewer_main(pid: int, directory: Path, hz: float) -> int:
    """A memtop-like viewer: one connection, `sample` at `hz` while switched on via stdin."""
    from memtop.sources.agents import AgentClient

    children.die_with_parent(os.getppid(), lambda: os._exit(1))  # a bench stopped by KILL
    client = AgentClient(pid, directory)
    client.connect()
    active, stop = threading.Event(), threading.Event()

    def read_commands() -> None:
        for line in sys.stdin:
            command = line.strip()
            if command == "on":
                active.set()
            elif command == "off":
                active.clear()
            elif command == "quit":
                break
        stop.set()
        active.set()

    threading.Thread(target=read_commands, daemon=True).start()
    served, marks, rtts = 0, 0, []
    period = 1.0 / hz
    while not stop.is_set():
        active.wait()
        next_at = time.monotonic()
        while active.is_set() and not stop.is_set():
            started = time.perf_counter()
            sample = client.sample()
            rtts.append(time.perf_counter() - started)
            served += 1
            marks += len(sample.step_marks)
            next_at += period
            delay = next_at - time.monotonic()
            if delay > 0:
                stop.wait(delay)
            else:
                next_at = time.monotonic()
    client.close()
    print(
        json.dumps(
            {
                "samples_served": served,
                "step_marks_received": marks,
                "sample_rtt_ms_median": 1000 * statistics.median(rtts) if rtts else 0.0,
                "viewer_cpu_s": time.process_time(),
            }
        ),
        flush=True,
    )
    return 0


# ---------------------------------------------------------------------------------- trainer


def thread_cpu_s(native_id: int | None) -> float:
    """CPU time of one thread of this process (Linux), 0.0 where it cannot be read."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as fh:
            return int(fh.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def trainer_main(args: argparse.Namespace) -> int:
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
    from torch import nn

    import memtop.agent
    from memtop.agent.server import Agent
    from memtop.agent.torch_probe import TorchProbe

    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = torch.device(args.device)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(args.width, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> float:
        started = time.perf_counter()
        x = torch.randn(args.batch, args.width, device=device)
        loss = model(x).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        sync()
        return time.perf_counter() - started

    # The agent's per-step work on the trainer's thread, timed on an agent that serves nobody.
    bare = Agent(TorchProbe())
    calls = 20000
    started = time.perf_counter()
    for _ in range(calls):
        bare.on_step()
    hook_us = 1e6 * (time.perf_counter() - started) / calls

    socket_dir = Path(tempfile.mkdtemp(prefix="mt-bench-"))
    agent = memtop.agent.start_agent(probe=TorchProbe(), socket_dir=socket_dir)
    if agent is None:
        print("agent did not start", file=sys.stderr)
        return 1
    probe = agent.probe
    assert isinstance(probe, TorchProbe)
    probe.remove_step_hook()  # the first block is "without"
    agent_tid = agent._thread.native_id if agent._thread is not None else None
    viewer = subprocess.Popen(
        [sys.executable, __file__, "--viewer", str(os.getpid()), str(socket_dir), str(args.hz)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert viewer.stdin is not None and viewer.stdout is not None
    viewer_stdin = viewer.stdin

    def switch(on: bool) -> None:
        if args.condition in ("all", "hook"):
            if on:
                probe.install_step_hook(agent.on_step)
            else:
                probe.remove_step_hook()
        if args.condition in ("all", "samples"):
            viewer_stdin.write("on\n" if on else "off\n")
            viewer_stdin.flush()

    print(
        f"torch {torch.__version__} on {device}, 1 thread; MLP {args.layers}x{args.width}, "
        f"batch {args.batch}, AdamW; viewer at {args.hz:g} Hz in pid {viewer.pid}; "
        f"'with' adds: {args.condition}",
        flush=True,
    )
    deadline = time.monotonic() + WARMUP_S
    while time.monotonic() < deadline:
        step()

    n_blocks = max(4, int((args.seconds - WARMUP_S) / args.block))
    n_blocks -= n_blocks % 4
    order = [i % 4 in (1, 2) for i in range(n_blocks)]  # ABBA; True = with
    times: dict[bool, list[float]] = {False: [], True: []}
    blocks: list[tuple[bool, list[float]]] = []
    wall = {False: 0.0, True: 0.0}
    with_seconds = 0.0  # all of the "with" time, settling included: the viewer samples through it
    agent_cpu = {False: 0.0, True: 0.0}
    current = False
    for with_agent in order:
        if with_agent != current:
            switch(with_agent)
            current = with_agent
        block: list[float] = []
        begin = time.monotonic()
        settled = begin + SETTLE_S
        while time.monotonic() < settled:
            step()
        cpu0, wall0 = thread_cpu_s(agent_tid), time.perf_counter()
        while time.monotonic() < begin + args.block:
            block.append(step())
        agent_cpu[with_agent] += thread_cpu_s(agent_tid) - cpu0
        wall[with_agent] += time.perf_counter() - wall0
        if with_agent:
            with_seconds += time.monotonic() - begin
        times[with_agent] += block
        blocks.append((with_agent, block))
    switch(False)
    viewer_stdin.write("quit\n")
    viewer_stdin.flush()
    out, _ = viewer.communicate(timeout=30)
    served = json.loads(out.strip().splitlines()[-1])
    agent_steps = agent.step or 0
    errors = list(agent.errors)
    memtop.agent.stop_agent()
    shutil.rmtree(socket_dir, ignore_errors=True)

    with_ms = 1000 * statistics.median(times[True])
    without_ms = 1000 * statistics.median(times[False])
    mean_with = 1000 * statistics.fmean(times[True])
    mean_without = 1000 * statistics.fmean(times[False])
    ratio, mean_ratio = with_ms / without_ms, mean_with / mean_without
    # Paired: each ABBA quartet gives one ratio of its with-blocks to its without-blocks.
    paired_means = []
    for i in range(0, len(blocks), 4):
        quartet = blocks[i : i + 4]
        w = [t for on, b in quartet if on for t in b]
        wo = [t for on, b in quartet if not on for t in b]
        paired_means.append(statistics.fmean(w) / statistics.fmean(wo))
    paired = statistics.median(paired_means)
    agent_cpu_with = agent_cpu[True] / wall[True]
    agent_cpu_without = agent_cpu[False] / wall[False]
    hook_share = hook_us / 1000 / mean_without if args.condition in ("all", "hook") else 0.0
    bound = 100 * (hook_share + max(0.0, agent_cpu_with - agent_cpu_without))
    steps = len(times[True]) + len(times[False])
    n_served = served["samples_served"]
    sample_hz = n_served / with_seconds if with_seconds else 0.0

    print(f"blocks: {len(order)} x {args.block:g} s (ABBA), steps measured: {steps}")
    print(f"step without agent: median {without_ms:7.3f} ms, mean {mean_without:7.3f} ms")
    print(f"step with agent:    median {with_ms:7.3f} ms, mean {mean_with:7.3f} ms")
    print(
        f"overhead: median {100 * (ratio - 1):+.2f} %, mean {100 * (mean_ratio - 1):+.2f} %, "
        f"paired ABBA mean {100 * (paired - 1):+.2f} % (timing noise on this machine: run "
        "--condition nothing)"
    )
    print(f"step hook: {hook_us:.2f} us per step = {100 * hook_us / 1000 / mean_without:.4f} %")
    print(
        f"agent thread CPU: {100 * agent_cpu_with:.3f} % of a core with, "
        f"{100 * agent_cpu_without:.3f} % without"
    )
    print(f"cost bound (hook + agent thread CPU, fully serialised): {bound:.3f} % of step time")
    print(
        f"samples served: {n_served} ({sample_hz:.1f} Hz), median round "
        f"trip {served['sample_rtt_ms_median']:.3f} ms; step marks received: "
        f"{served['step_marks_received']} of {agent_steps} steps counted"
    )
    if errors:
        print(f"agent errors: {errors}")
    print(
        json.dumps(
            {
                "overhead_ratio": round(ratio, 5),
                "overhead_ratio_mean": round(mean_ratio, 5),
                "overhead_ratio_paired": round(paired, 5),
                "cost_bound_pct": round(bound, 4),
                "median_step_ms_with": round(with_ms, 4),
                "median_step_ms_without": round(without_ms, 4),
                "mean_step_ms_with": round(mean_with, 4),
                "mean_step_ms_without": round(mean_without, 4),
                "steps": steps,
                "samples_served": n_served,
                "sample_hz": round(sample_hz, 2),
                "step_marks_received": served["step_marks_received"],
                "agent_steps_counted": agent_steps,
                "hook_us_per_step": round(hook_us, 3),
                "agent_thread_cpu_pct_with": round(100 * agent_cpu_with, 4),
                "agent_thread_cpu_pct_without": round(100 * agent_cpu_without, 4),
                "blocks": len(order),
                "condition": args.condition,
                "agent_errors": len(errors),
                "device": str(device),
                "torch": torch.__version__,
            }
        )
    )
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--viewer":
        return viewer_main(int(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4]))
    parser = argparse.ArgumentParser(description="trainer slowdown from an attached memtop agent")
    parser.add_argument("--seconds", type=float, default=40.0, help="total run time")
    parser.add_argument("--block", type=float, default=1.0, help="seconds per block")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--hz", type=float, default=10.0, help="viewer sample rate")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--condition",
        choices=("all", "hook", "samples", "nothing"),
        default="all",
        help="what 'with' blocks add: all (the budget's case, default), only the step hook, "
        "only the samples, or nothing (an A/A run: the noise floor)",
    )
    return trainer_main(parser.parse_args())


if __name__ == "__main__":
    # Ctrl-C, SIGTERM (`timeout`) and SIGHUP unwind main: what it started is stopped.
    sys.exit(children.run_stopping_children(main))
