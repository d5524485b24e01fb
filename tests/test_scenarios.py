"""Each simulated workload shows the memory behaviour its name promises."""

from __future__ import annotations

import itertools

import pytest

from memtop.sim.allocator import SimulatedCachingAllocator
from memtop.sim.device import LocalDeviceMemory
from memtop.sim.scenarios import MiB, Workload, model_for

GiB = 1 << 30
TOTAL = 80 * GiB


def run(scenario: str, steps: int, conf: str = "", total: int = TOTAL, **kwargs):
    allocator = SimulatedCachingAllocator(LocalDeviceMemory(total, 518 * MiB), 0, conf)
    gauge: list[float] = []

    def observe() -> None:
        stats = allocator.memory_stats()
        reserved = stats["reserved_bytes.large_pool.current"]
        gauge.append(stats["inactive_split_bytes.large_pool.current"] / reserved if reserved else 0)

    workload = Workload(
        scenario, allocator, model_for(scenario, total), seed=3, pace=observe, **kwargs
    )
    baselines = []
    for _ in range(steps):
        workload.step()
        baselines.append(allocator.memory_allocated())
    return allocator, workload, baselines, gauge


def test_healthy_is_a_flat_sawtooth():
    allocator, workload, baselines, _ = run("healthy", 40)
    assert len(set(baselines[2:])) == 1  # the same baseline after every step
    stats = allocator.memory_stats()
    # Activations on top of parameters, gradients and Adam's state (the baseline).
    assert stats["allocated_bytes.all.peak"] > baselines[-1] * 1.15
    assert stats["num_alloc_retries"] == 0 and workload.ooms == 0


def test_leak_grows_by_the_configured_bytes_per_step():
    _, _, baselines, _ = run("leak", 40, leak_bytes_per_step=24 * MiB)
    growth = [b - a for a, b in itertools.pairwise(baselines[2:])]
    assert all(g == 24 * MiB + 512 for g in growth)  # the kept tensor and the kept loss


def test_leaking_trainer_runs_out_then_restarts():
    _, workload, baselines, _ = run("leak", 160, total=20 * GiB, leak_bytes_per_step=128 * MiB)
    assert workload.ooms >= 1
    assert min(baselines[-20:]) < max(baselines)  # the restart dropped what had leaked
    assert workload.steps > 100


def test_fragment_keeps_split_segments():
    _, _, _, gauge = run("fragment", 120)
    settled = gauge[len(gauge) // 3 :]
    assert sum(settled) / len(settled) >= 0.2


def test_fragment_with_expandable_segments_reports_no_split_bytes():
    _, _, _, gauge = run("fragment", 60, conf="expandable_segments:True")
    assert max(gauge) < 0.01


@pytest.mark.slow
def test_pressure_runs_near_capacity_and_retries():
    allocator, workload, _, _ = run("pressure", 300)
    free, total = allocator.mem_get_info()
    assert (total - free) / total >= 0.95
    assert allocator.memory_stats()["num_alloc_retries"] > 0
    assert workload.steps >= 250  # OOMs, if any, stay rare


def test_breakdown_accounts_for_model_state():
    allocator, workload, _, _ = run("healthy", 3)
    (breakdown,) = workload.breakdown(0).values()
    assert breakdown.optimizer_state == 2 * breakdown.parameters
    assert breakdown.parameters > 1 * GiB
    # Measured at the step boundary, right after the optimizer step, as the agent measures a
    # real trainer: the gradients are alive there (zero_grad opens the next step), and equal
    # the trained parameters' bytes, as the CHANGELOG says (the breakdown showed 0 B).
    assert breakdown.gradients == breakdown.parameters
    assert breakdown.allocated == allocator.memory_allocated()
    assert breakdown.other == breakdown.allocated - 4 * breakdown.parameters


def test_unknown_scenario_is_refused():
    allocator = SimulatedCachingAllocator(LocalDeviceMemory(GiB), 0)
    with pytest.raises(ValueError, match="unknown scenario"):
        Workload("chaos", allocator, model_for("healthy", GiB))
