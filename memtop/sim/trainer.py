"""A simulated trainer process: one scenario on one simulated GPU, with the real agent.

Started by `memtop demo` as `python -m memtop.sim.trainer --registry DIR --gpu I --scenario S`.
It behaves like a trainer under `memtop run`: the agent listens on the usual socket, steps are
marked after every optimizer step, and SIGTERM/SIGINT stop it cleanly (socket and ledger entry
removed).  With `--parent PID` (the demo passes its own) it stops as cleanly when that process is
gone, however it ended (memtop.base.children.die_with_parent).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import memtop
from memtop import protocol
from memtop.agent.probe import ProbeDevice, allocator_conf_from_env
from memtop.base.children import StopFlag, die_with_parent
from memtop.sim.allocator import SimulatedCachingAllocator
from memtop.sim.device import SimGpuRegistry
from memtop.sim.probe import SimulatedGpu, SimulatedProbe
from memtop.sim.scenarios import (
    SCENARIOS,
    SERVER_SCENARIOS,
    MiB,
    ServerWorkload,
    Workload,
    model_for,
)

# What a CUDA context, cuBLAS workspaces and friends take outside the caching allocator.
CONTEXT_OVERHEAD_BYTES = 518 * MiB
# What a ROCm build of torch says in torch.version.hip (ROCm 7.0).
SIMULATED_HIP_VERSION = "7.0.51831"
# The variables that renumber GPUs for a process, by vendor, in the order the runtime applies
# them (on ROCm, HIP_VISIBLE_DEVICES selects among what ROCR_VISIBLE_DEVICES left).
VISIBLE_DEVICES = {
    "nvidia": ("CUDA_VISIBLE_DEVICES",),
    "amd": ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"),
}


def physical_gpu(visible_index: int, vendor: str, env: dict[str, str]) -> int | None:
    """The registry's GPU behind the trainer's device `visible_index` (its cuda:N), as the
    vendor's runtime maps it through the *_VISIBLE_DEVICES variables; None when hidden."""
    indices: list[int] | None = None
    for name in VISIBLE_DEVICES[vendor]:
        text = env.get(name)
        if text is None:
            continue
        numbers = (protocol.decimal(part.strip()) for part in text.split(","))
        chosen = [n for n in numbers if n is not None]  # UUIDs in the list: not simulated
        indices = chosen if indices is None else [indices[i] for i in chosen if i < len(indices)]
    if indices is None:
        return visible_index
    return indices[visible_index] if 0 <= visible_index < len(indices) else None


def hip_uuid(driver_uuid: str) -> str:
    """The UUID a ROCm build of torch reports for a GPU: HIP's, not amdsmi's (which is why the
    viewer joins AMD GPUs by PCI bus id)."""
    return "GPU-" + driver_uuid.replace("-", "")[:16]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="memtop-sim-trainer")
    parser.add_argument("--registry", required=True, type=Path)
    parser.add_argument(
        "--gpu", type=int, default=0, help="the trainer's device (cuda:N, after *_VISIBLE_DEVICES)"
    )
    parser.add_argument("--scenario", choices=SCENARIOS, default="healthy")
    parser.add_argument("--step-time", type=float, default=0.1)
    parser.add_argument("--scale", type=float, default=1.0, help="model size factor")
    parser.add_argument("--leak-mib", type=float, default=8.0, help="leak per step (leak)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.92,
        help="the share of the GPU a server scenario takes at start (as vLLM's flag)",
    )
    parser.add_argument(
        "--grow-after", type=int, default=40, help="bursts before server-overrun grows"
    )
    parser.add_argument("--max-steps", type=int, default=0, help="stop after N steps (0: never)")
    parser.add_argument(
        "--parent", type=int, default=None, help="stop when this process (the demo) is gone"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    registry = SimGpuRegistry(args.registry)
    specs = {spec.index: spec for spec in registry.gpus()}
    vendor = next(iter(specs.values())).vendor if specs else "nvidia"
    physical = physical_gpu(args.gpu, vendor, dict(os.environ))
    if physical not in specs:
        print(
            f"memtop-sim-trainer: no simulated GPU {args.gpu} in {args.registry}", file=sys.stderr
        )
        return 1
    spec = specs[physical]
    # The trainer's own numbering (cuda:N) from here on; the ledger is the physical GPU's.
    index = args.gpu
    amd = spec.vendor == "amd"
    device = ProbeDevice(
        index,
        hip_uuid(spec.uuid) if amd else spec.uuid,
        spec.name,
        spec.total_bytes,
        spec.pci_bus_id,
    )
    conf = allocator_conf_from_env(os.environ)
    memory = registry.memory(spec.index, os.getpid(), overhead_bytes=CONTEXT_OVERHEAD_BYTES)
    allocator = SimulatedCachingAllocator(memory, index, conf)
    stop = StopFlag()  # raised by SIGTERM/SIGINT: not a threading.Event (children.StopFlag)
    # Forward and backward visit 24 layers each: a pause at every 4th visit, 12 a step, spreads
    # the step's work over its time for an observer to sample mid-step.  Each pause is a wakeup,
    # and a pause at every visit (48 a step) cost a trainer a sixth of its CPU.
    # The step's new segments reach the GPU's ledger before each pause, a write a pause.
    visits_per_pause = 4
    layer_pause = args.step_time * 0.8 / (48 // visits_per_pause)

    def pace() -> None:
        stop.wait(layer_pause)

    def log(message: str) -> None:
        print(f"[pid {os.getpid()}] {message}", file=sys.stderr, flush=True)

    workload: Workload | ServerWorkload
    if args.scenario in SERVER_SCENARIOS:
        workload = ServerWorkload(
            args.scenario,
            allocator,
            spec.total_bytes,
            args.gpu_memory_utilization,
            CONTEXT_OVERHEAD_BYTES,
            seed=args.seed,
            grow_after=args.grow_after,
            log=log,
        )
        # What the process table shows: a vLLM server, flags and all (how memtop knows it).
        shown_argv = [
            "vllm",
            "serve",
            "sim/llama-3-8b",
            "--gpu-memory-utilization",
            f"{args.gpu_memory_utilization:g}",
        ]
    else:
        workload = Workload(
            args.scenario,
            allocator,
            model_for(args.scenario, spec.total_bytes, args.scale),
            seed=args.seed,
            leak_bytes_per_step=int(args.leak_mib * MiB),
            log=log,
            pace=pace,
            layers_per_pause=visits_per_pause,
        )
        # What the process table shows: the workload, not the simulator's plumbing.
        shown_argv = ["sim_train.py", f"--scenario={args.scenario}", f"--gpu={args.gpu}"]
    probe = SimulatedProbe(
        [SimulatedGpu(device, allocator)],
        allocator_conf=conf,
        breakdown=lambda: workload.breakdown(index),
        current_pass=lambda: workload.current_pass,
        hip=SIMULATED_HIP_VERSION if amd else None,
    )
    agent = memtop.start_agent(probe=probe, argv=shown_argv)
    if agent is None:
        return 1

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.parent is not None:
        # The demo runs its trainers in sessions of their own (a Ctrl-C in the dashboard is
        # not theirs), so a closed terminal does not reach them: they end with the demo,
        # however it ended (SIGKILL and crashes included).
        die_with_parent(args.parent, stop.set)
    next_step = time.monotonic()
    try:
        while not stop.is_set():
            # A server serves bursts: it never marks a step (that is how memtop tells it).
            if workload.step() and not isinstance(workload, ServerWorkload):
                memtop.step()
            if args.max_steps and workload.steps >= args.max_steps:
                break
            next_step += args.step_time * (0.9 + 0.2 * workload.rng.random())
            delay = next_step - time.monotonic()
            if delay > 0:
                stop.wait(delay)
            else:
                next_step = time.monotonic()
    finally:
        memtop.agent.stop_agent()
        memory.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
