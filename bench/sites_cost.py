"""What naming the line costs (issue 23), on the CPU: the simulated trainer with the real agent.

    .venv/bin/python bench/sites_cost.py [--steps 200]

Prints, JSON last:
- the OOM observer's stack capture (µs per call), from a user line under 30 frames of library
  code (torch's nn.Module calls when torch is installed, else plain frames);
- the simulated allocator's malloc+free with history off and on (µs per pair);
- the simulated `leak` trainer's step time with stacks off and on (medians), and the agent's own
  share of the step with stacks on (its step hook with the switch and the grouping rounds
  amortised; the rest is the allocator recording frames, which on CUDA is torch's own cost);
- one grouping round (ms) and the blocks it walked;
- the history of rounds (DESIGN §13), every round kept (HISTORY_EVERY_S = 0, the worst case for
  the trainer's thread, which sizes each kept round as JSON): the rounds and bytes kept, and what
  a viewer's first `sites` request costs the agent thread (the reply built and framed, µs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memtop.agent import sites, stacks  # noqa: E402
from memtop.agent.probe import ProbeDevice  # noqa: E402
from memtop.agent.server import Agent  # noqa: E402
from memtop.protocol import encode_frame  # noqa: E402
from memtop.sim.allocator import SimulatedCachingAllocator  # noqa: E402
from memtop.sim.device import LocalDeviceMemory  # noqa: E402
from memtop.sim.probe import SimulatedGpu, SimulatedProbe  # noqa: E402
from memtop.sim.scenarios import Workload, model_for  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20


def capture_cost(calls: int = 2000) -> float:
    def library(n: int) -> list[dict[str, object]]:
        return library(n - 1) if n else user_line()

    def user_line() -> list[dict[str, object]]:
        return stacks.capture()  # the failing request

    library(30)  # warm linecache and the file classification, as a second OOM finds them
    started = time.perf_counter()
    for _ in range(calls):
        library(30)
    with_capture = time.perf_counter() - started

    def plain(n: int) -> None:
        return plain(n - 1) if n else None

    started = time.perf_counter()
    for _ in range(calls):
        plain(30)
    recursion = time.perf_counter() - started
    return (with_capture - recursion) / calls * 1e6


def malloc_cost(history: bool, pairs: int = 20000) -> float:
    allocator = SimulatedCachingAllocator(LocalDeviceMemory(8 * GiB), 0)
    allocator.record_history(history)
    started = time.perf_counter()
    for _ in range(pairs):
        allocator.free(allocator.malloc(MiB))
    return (time.perf_counter() - started) / pairs * 1e6


def trainer_cost(stacks_on: bool, steps: int) -> dict[str, float]:
    allocator = SimulatedCachingAllocator(LocalDeviceMemory(16 * GiB), 0)
    device = ProbeDevice(0, "GPU-bench", "Sim GPU", 16 * GiB)
    workload = Workload(
        "leak", allocator, model_for("leak", 16 * GiB, 0.2), leak_bytes_per_step=MiB
    )
    probe = SimulatedProbe([SimulatedGpu(device, allocator)])
    agent = Agent(probe, Path(tempfile.mkdtemp(prefix="memtop-bench-")))
    agent.start()
    agent.sites.wanted = stacks_on
    try:
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            workload.step()
            agent.on_step(explicit=True)
            times.append(time.perf_counter() - started)
        return {
            "step_ms_median": statistics.median(times) * 1e3,
            "step_ms_mean": statistics.fmean(times) * 1e3,
            "grouping_rounds": agent.sites.rounds,
            "grouping_ms_last": agent.sites.last_round_s * 1e3,
            "grouping_ms_total": agent.sites.total_s * 1e3,
            "blocks_last_round": (agent.sites.latest or {}).get("blocks", 0),
            "hook_us_per_step": agent.boundary.hook_ns / max(1, agent.boundary.hook_calls) / 1e3,
            **(history_cost(agent) if stacks_on else {}),
        }
    finally:
        agent.stop()


def history_cost(agent: Agent, calls: int = 200) -> dict[str, float]:
    """The kept rounds, and a first `sites` reply with them built and framed (agent thread)."""
    kept = getattr(agent.sites, "history", None)
    if kept is None:
        return {}  # an agent without a history (before DESIGN §13)
    started = time.perf_counter()
    for _ in range(calls):
        frame = encode_frame({"id": 1, "ok": True, "result": agent.sites.result(history=True)})
    return {
        "history_rounds": len(kept),
        "history_bytes": sum(n for _, n in kept),
        "first_reply_bytes": len(frame),
        "first_reply_us": (time.perf_counter() - started) / calls * 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    # Rounds as often as they may come, so that a short run sees several.
    sites.MIN_INTERVAL_S = 0.5
    sites.HISTORY_EVERY_S = 0.0  # every round kept (an agent before DESIGN §13 ignores it)
    result = {
        "oom_stack_capture_us": round(capture_cost(), 1),
        "sim_malloc_free_us_history_off": round(malloc_cost(False), 2),
        "sim_malloc_free_us_history_on": round(malloc_cost(True), 2),
        "trainer_stacks_off": trainer_cost(False, args.steps),
        "trainer_stacks_on": trainer_cost(True, args.steps),
    }
    off, on = result["trainer_stacks_off"], result["trainer_stacks_on"]
    # Medians: this box is shared, and a mean takes every other process's burst.
    result["stacks_on_step_change_pct"] = round(
        100 * (on["step_ms_median"] - off["step_ms_median"]) / off["step_ms_median"], 2
    )
    # The agent's own share with stacks on: its step hook (switch, rounds amortised) against
    # the step; the rest of any change is the allocator recording frames (torch's own cost).
    result["agent_share_of_step_pct_stacks_on"] = round(
        100 * on["hook_us_per_step"] / 1e3 / on["step_ms_median"], 2
    )
    for key, value in result.items():
        print(f"{key:36} {value}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
