"""The simulator's workload scenarios by name: one list for the trainer, the demo and the CLI.

Light on purpose (the CLI's parser and every simulated trainer read it at start; Choice from
memtop.base, not memtop.model's records): the workloads themselves are in
memtop.sim.scenarios, the demo's plans in memtop.sim.demo."""

from __future__ import annotations

from memtop.base.choice import Choice


class Scenario(Choice):
    HEALTHY = "healthy"
    LEAK = "leak"  # retains memory every step
    FRAGMENT = "fragment"  # variable sequence lengths
    PRESSURE = "pressure"  # runs at 90-97 % of the device, hits retries
    OOM = "oom"  # a batch that grows until it does not fit
    SERVER = "server"  # a vLLM-like inference server: its share taken at start, flat, no steps
    SERVER_OVERRUN = "server-overrun"  # the same server, then memory beyond its share grows
    MIXED = "mixed"  # the demo only: several GPUs, several trainers, each its own scenario


# What one simulated trainer runs, and what `memtop demo --scenario` takes (plain strings: the
# words argparse lists in --help and in its errors).
TRAINER_SCENARIOS: tuple[str, ...] = tuple(s.value for s in Scenario if s is not Scenario.MIXED)
DEMO_SCENARIOS: tuple[str, ...] = tuple(s.value for s in Scenario)
