"""The changes that make a setup fit a GPU, cheapest for the user first (issue 24).

Each way is one change to the Setup (two when no single change fits), estimated with the same
arithmetic as the setup itself, so its figure is as good as the estimate's.  The order is what
a change costs the user, not the bytes it saves: keeping the global batch by accumulating
gradients costs only step time; an 8-bit or paged optimizer a dependency; recomputation a
third more compute; bf16 weights some precision; CPU offload slow optimizer steps; more GPUs
money; LoRA / QLoRA a different kind of training.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from memtop.base.records import record
from memtop.estimate.architecture import Architecture, ArchitectureError
from memtop.estimate.memory import Estimate, Setup, estimate, max_batch, usable_bytes

# A setup with less than this share of the usable memory to spare lists its ways to fit too:
# a run planned at 95 % dies at its first longer batch.
SPARE_SHARE = 0.10
GPU_COUNTS = (2, 4, 8, 16, 32, 64, 128, 256)
ADAPTER_RANK = 16


@record(frozen=True, slots=True)
class Way:
    change: str  # the flags to add, as `memtop estimate` takes them
    what: str  # the change in words
    cost: str  # what it costs the user
    rank: int  # the order of cost (lower is cheaper for the user)
    setup: Setup


def needs_ways(est: Estimate, capacity: int) -> bool:
    usable = usable_bytes(capacity)
    return est.required_bytes > usable * (1 - SPARE_SHARE)


def _candidates(arch: Architecture, setup: Setup, capacity: int) -> Iterator[Way]:
    """Single changes of `setup` that might lower its memory."""
    if setup.batch > 1:
        micro = max_batch(arch, replace(setup, batch=1), capacity)
        micro = min(micro, setup.batch - 1)
        if micro >= 1:
            steps = math.ceil(setup.batch / micro)
            yield Way(
                f"--batch {micro} (× {steps} accumulation steps)",
                f"micro-batch {micro} with gradient accumulation over {steps} steps",
                f"the same global batch of {setup.batch}; {steps} forward/backward passes per "
                "optimizer step (a little slower)",
                0,
                replace(setup, batch=micro),
            )
    if setup.optimizer in ("adamw", "adam"):
        yield Way(
            "--optimizer adamw-8bit",
            "8-bit AdamW (bitsandbytes.optim.AdamW8bit)",
            "a bitsandbytes dependency; 8-bit moments train to the same loss in its paper",
            1,
            replace(setup, optimizer="adamw-8bit"),
        )
    if setup.optimizer not in ("paged-adamw-8bit", "sgd"):
        yield Way(
            "--optimizer paged-adamw-8bit",
            "paged 8-bit AdamW (bitsandbytes.optim.PagedAdamW8bit)",
            "a bitsandbytes dependency; steps slow down while its state is paged to CPU memory",
            2,
            replace(setup, optimizer="paged-adamw-8bit"),
        )
    if setup.checkpointing == "none":
        yield Way(
            "--checkpointing full",
            "gradient checkpointing of every layer",
            "about a third more compute per step (each layer's forward runs twice)",
            3,
            replace(setup, checkpointing="full"),
        )
    if setup.master_weights and not setup.lora:
        yield Way(
            "(without --master-weights)",
            "pure bf16 training: no fp32 master copy, bf16 moments",
            "updates smaller than bf16's precision are lost; use a Kahan-summation or "
            "stochastic-rounding optimizer if the loss stalls",
            4,
            replace(setup, master_weights=False),
        )
    if setup.dtype == "fp32" and not setup.lora:
        yield Way(
            "--dtype bf16 --master-weights",
            "bf16 weights and gradients with an fp32 master copy (mixed precision)",
            "code changes for mixed precision; half the weight and gradient memory",
            4,
            replace(setup, dtype="bf16", autocast=False, master_weights=True),
        )
    if not setup.offload_optimizer and setup.optimizer != "sgd":
        yield Way(
            "--offload-optimizer",
            "optimizer state and master weights in CPU memory (DeepSpeed ZeRO-Offload)",
            "DeepSpeed; the optimizer step runs on the CPU (slower steps, CPU memory needed)",
            5,
            replace(setup, offload_optimizer=True),
        )
    if not setup.lora:
        stage = max(setup.zero_stage, 3)
        for gpus in GPU_COUNTS:
            if gpus <= setup.gpus:
                continue
            yield Way(
                f"--zero {stage} --gpus {gpus}",
                f"ZeRO-{stage} over {gpus} GPUs",
                f"{gpus} GPUs instead of {setup.gpus}; DeepSpeed or FSDP",
                6,
                replace(setup, zero_stage=stage, gpus=gpus),
            )
        yield Way(
            f"--lora-rank {ADAPTER_RANK}",
            f"LoRA adapters of rank {ADAPTER_RANK} (PEFT's default targets)",
            "trains adapters, not the whole model: not a full fine-tune",
            7,
            replace(setup, lora_rank=ADAPTER_RANK, master_weights=False),
        )
    if setup.quantize_base is None:
        rank = setup.lora_rank or ADAPTER_RANK
        yield Way(
            "--qlora" + ("" if setup.lora_rank else f" --lora-rank {rank}"),
            f"QLoRA: a 4-bit NF4 base under LoRA adapters of rank {rank}",
            "adapters only, on a 4-bit base: slightly lower quality, slower matmuls",
            8,
            replace(setup, lora_rank=rank, quantize_base="4bit", master_weights=False),
        )


def _describe(
    way: Way, est: Estimate, capacity: int, batch_of: Callable[[Setup], int]
) -> dict[str, Any]:
    usable = usable_bytes(capacity)
    return {
        "change": way.change,
        "what": way.what,
        "cost": way.cost,
        "total_bytes": est.total_bytes,
        "required_bytes": est.required_bytes,
        "fits": est.required_bytes <= usable,
        "free_bytes": usable - est.required_bytes,
        "max_batch": batch_of(way.setup),
    }


def ways_to_fit(arch: Architecture, setup: Setup, capacity: int) -> list[dict[str, Any]]:
    """The changes that make `setup` fit `capacity` bytes, cheapest for the user first; [] when
    it fits with SPARE_SHARE to spare.  Only the first of the GPU counts that fits is listed;
    two changes together only when no single one fits."""
    try:
        current = estimate(arch, setup)
    except ArchitectureError:
        return []
    if not needs_ways(current, capacity):
        return []
    usable = usable_bytes(capacity)

    def batch_of(candidate: Setup) -> int:
        return max_batch(arch, candidate, capacity)

    found: list[tuple[int, int, dict[str, Any]]] = []
    singles: list[tuple[Way, Estimate]] = []
    more_gpus_listed = False
    for way in _candidates(arch, setup, capacity):
        try:
            est = estimate(arch, way.setup)
        except ArchitectureError:
            continue
        if est.required_bytes >= current.required_bytes:
            continue  # it does not help this setup
        singles.append((way, est))
        if est.required_bytes <= usable:
            if way.rank == 6:
                if more_gpus_listed:
                    continue
                more_gpus_listed = True
            found.append((way.rank, est.total_bytes, _describe(way, est, capacity, batch_of)))
    if not found:
        # No single change is enough: two together (the cheapest pairs).
        for (a, _), (b, _) in itertools.combinations(singles, 2):
            if a.rank == b.rank:
                continue
            merged = _merge(setup, a.setup, b.setup)
            try:
                est = estimate(arch, merged)
            except ArchitectureError:
                continue
            if est.required_bytes <= usable:
                both = Way(
                    f"{a.change} {b.change}",
                    f"{a.what}, and {b.what}",
                    f"{a.cost}; {b.cost}",
                    a.rank + b.rank,
                    merged,
                )
                found.append((both.rank, est.total_bytes, _describe(both, est, capacity, batch_of)))
        found = sorted(found, key=lambda f: (f[0], f[1]))[:6]
    return [way for _, _, way in sorted(found, key=lambda f: (f[0], f[1]))]


def _merge(base: Setup, a: Setup, b: Setup) -> Setup:
    """`base` with the fields `a` changed and then those `b` changed."""
    changes = {
        name: getattr(x, name)
        for x in (a, b)
        for name in Setup.__dataclass_fields__
        if getattr(x, name) != getattr(base, name)
    }
    return replace(base, **changes)
