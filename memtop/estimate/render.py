"""The estimate as a table for people and as one JSON object (DESIGN §11: `weights_bytes`,
`gradients_bytes`, `optimizer_state_bytes`, `activations_bytes`, `overhead_bytes`,
`total_bytes`, `parameters_count`, `fits`, `max_batch`; sizes are integer bytes per GPU)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from memtop.estimate.architecture import Architecture
from memtop.estimate.calibrate import BatchModel
from memtop.estimate.fit import ways_to_fit
from memtop.estimate.memory import (
    CUDA_CONTEXT_BYTES,
    Estimate,
    Setup,
    max_batch,
    usable_bytes,
)
from memtop.estimate.reference import deepspeed_zero2_gpu_bytes, deepspeed_zero3_gpu_bytes
from memtop.units import format_bytes


@dataclass(frozen=True, slots=True)
class Target:
    """A GPU to fit in: a named one, or one of this machine's (source "nvml")."""

    name: str
    total_bytes: int
    source: str  # "named" | "nvml"
    index: int | None = None


def verdicts(est: Estimate, targets: list[Target]) -> list[dict[str, Any]]:
    out = []
    for target in targets:
        usable = usable_bytes(target.total_bytes)
        out.append(
            {
                "name": target.name,
                "index": target.index,
                "source": target.source,
                "total_bytes": target.total_bytes,
                "usable_bytes": usable,
                "fits": est.required_bytes <= usable,
                "free_bytes": usable - est.required_bytes,
                "max_batch": max_batch(est.arch, est.setup, target.total_bytes),
            }
        )
    return out


def reference(est: Estimate) -> dict[str, Any]:
    setup = est.setup
    ref: dict[str, Any] = {}
    if setup.zero_stage in (1, 2) and not setup.lora:
        ref["deepspeed_zero2_model_states_bytes"] = deepspeed_zero2_gpu_bytes(
            est.parameters_count, setup.gpus
        )
    if setup.zero_stage == 3 and not setup.lora:
        ref["deepspeed_zero3_model_states_bytes"] = deepspeed_zero3_gpu_bytes(
            est.parameters_count, est.arch.largest_layer_params(), setup.gpus
        )
    return ref


def to_json(est: Estimate, targets: list[Target]) -> dict[str, Any]:
    checks = verdicts(est, targets)
    setup = asdict(est.setup)
    setup["lora_targets"] = list(est.setup.lora_targets)
    return {
        "model": est.arch.as_dict(),
        "setup": setup,
        "parameters_count": est.parameters_count,
        "trainable_parameters_count": est.trainable_parameters_count,
        "weights_bytes": est.weights_bytes,
        "gradients_bytes": est.gradients_bytes,
        "optimizer_state_bytes": est.optimizer_state_bytes,
        "activations_bytes": est.activations_bytes,
        "overhead_bytes": est.overhead_bytes,
        "model_states_bytes": est.model_states_bytes,
        "total_bytes": est.total_bytes,
        "details": est.details,
        "reference": reference(est),
        # The first target decides the top-level verdict; every target is listed.
        "fits": all(c["fits"] for c in checks) if checks else None,
        "max_batch": min(c["max_batch"] for c in checks) if checks else None,
        "targets": checks,
        # For the first target: the changes that make it fit, cheapest for the user first.
        "ways_to_fit": ways(est, targets),
    }


def ways(est: Estimate, targets: list[Target]) -> list[dict[str, Any]]:
    if not targets:
        return []
    return ways_to_fit(est.arch, est.setup, targets[0].total_bytes)


# Why DeepSpeed's estimators differ from the table: they count one fixed recipe.
DEEPSPEED_NOTES = {
    "deepspeed_zero2_model_states_bytes": (
        "estimate_zero2_model_states_mem_needs",
        "16-bit weights and gradients whole on every GPU, 16 B a parameter partitioned "
        "(fp32 master weights, fp32 gradients, fp32 Adam moments)",
    ),
    "deepspeed_zero3_model_states_bytes": (
        "estimate_zero3_model_states_mem_needs",
        "18 B a parameter partitioned (16-bit weights and gradients, fp32 master weights, "
        "gradients and Adam moments) and the largest layer gathered whole at 4 B a parameter",
    ),
}


def _this_setup_states(est: Estimate) -> str:
    setup = est.setup
    moments = {
        "adamw": "two moments",
        "adam": "two moments",
        "sgd-momentum": "one momentum buffer",
        "lion": "one moment",
    }.get(setup.optimizer, f"{setup.optimizer} state")
    dtype = "fp32" if (setup.master_weights or setup.dtype == "fp32") else setup.dtype
    master = "fp32 master weights" if setup.master_weights else "no fp32 master weights"
    return (
        f"{setup.dtype} weights and gradients, {moments} in {dtype}, {master}, "
        "no fp32 gradient copy"
    )


def _describe_setup(arch: Architecture, setup: Setup) -> str:
    parts = [setup.dtype + (" + autocast" if setup.autocast else ""), setup.optimizer]
    if setup.master_weights:
        parts.append("fp32 master weights")
    if setup.lora:
        base = f"{setup.quantize_base} base" if setup.quantize_base else "LoRA"
        parts.append(f"{base} r={setup.lora_rank} on {','.join(setup.lora_targets)}")
    if setup.zero_stage:
        parts.append(f"ZeRO-{setup.zero_stage}")
    if setup.gpus > 1:
        parts.append(f"{setup.gpus} GPUs")
    if setup.checkpointing != "none":
        parts.append(f"{setup.checkpointing} checkpointing")
    parts.append(f"batch {setup.batch} × {setup.seq} tokens, {setup.attention} attention")
    return ", ".join(parts)


def to_text(est: Estimate, targets: list[Target]) -> str:
    arch, setup = est.arch, est.setup
    shape = (
        f"{arch.layers} layers, hidden {arch.hidden}, {arch.heads} heads, vocab {arch.vocab}"
        + (" (shape assumed from the count)" if arch.assumed else "")
    )
    trainable = (
        f", {est.trainable_parameters_count / 1e6:,.1f} M trainable"
        if est.trainable_parameters_count != est.parameters_count
        else ""
    )
    lines = [
        f"{arch.name}: {est.parameters_count / 1e9:.3f} B parameters{trainable}; {shape}",
        _describe_setup(arch, setup),
        "",
        f"{'per GPU':<20}{'bytes':>12}",
    ]
    rows = [
        ("weights", est.weights_bytes),
        ("gradients", est.gradients_bytes),
        ("optimizer state", est.optimizer_state_bytes),
        ("activations", est.activations_bytes),
        ("CUDA context etc.", est.overhead_bytes),
    ]
    lines += [f"  {name:<18}{format_bytes(value):>12}" for name, value in rows]
    lines.append(f"  {'total':<18}{format_bytes(est.total_bytes):>12}")
    if setup.checkpointing == "full":
        lines.append(
            "  activations with full recomputation: each layer's input kept (2·s·b·h·L, "
            "Korthikanti et al. 2022) plus one layer's activations recomputed in the backward "
            f"({format_bytes(est.details.get('activation_recomputed_layer_bytes', 0))}), "
            "which the paper's figure leaves out"
        )
    for name, value in reference(est).items():
        function, recipe = DEEPSPEED_NOTES[name]
        lines.append(
            f"  DeepSpeed's {function}: {format_bytes(value)} of model states per GPU for its "
            f"fixed recipe ({recipe}); the table above counts this setup "
            f"({format_bytes(est.model_states_bytes)} of model states: {_this_setup_states(est)})"
        )
    for check in verdicts(est, targets):
        where = check["name"] + (f" (GPU {check['index']})" if check["index"] is not None else "")
        room = format_bytes(abs(check["free_bytes"]))
        verdict = (
            f"fits, {room} to spare"
            if check["fits"]
            else f"does not fit: {room} over the usable {format_bytes(check['usable_bytes'])}"
        )
        batch = (
            f"largest micro-batch that fits: {check['max_batch']}"
            if check["max_batch"]
            else "not even a micro-batch of 1 fits"
        )
        paged = int(est.details.get("paged_optimizer_bytes", 0))
        if paged:
            verdict += (
                f" ({format_bytes(est.required_bytes)} must stay on the GPU: the paged "
                f"optimizer's {format_bytes(paged)} moves to CPU memory when the GPU is short)"
            )
        lines.append(f"{where}: {verdict}; {batch}")
    found = ways(est, targets)
    if found:
        lines.append(f"Ways to fit in {targets[0].name}, cheapest for you first:")
        for way in found:
            lines.append(
                f"  {way['change']}: {format_bytes(way['total_bytes'])}"
                f" (largest micro-batch {way['max_batch']}); {way['what']}; costs: {way['cost']}"
            )
    return "\n".join(lines)


# -- --from RECORDING: the run's own figures ---------------------------------------------------


def calibrated_limit(capacity: int) -> int:
    """What torch's cache may reserve on a GPU of `capacity` bytes: all but the CUDA context
    (outside torch's counters).  No share is kept back: the cache's overhead is measured."""
    return capacity - CUDA_CONTEXT_BYTES


def calibrated_json(
    measured: dict[str, Any], model: BatchModel, targets: list[Target], batch: int, source: str
) -> dict[str, Any]:
    """The estimate's fields (DESIGN §11) for `batch`, from the measured run, with
    `calibration` (DESIGN §12) saying what was measured and fitted."""
    peak, reserved = model.peak_at(batch), model.reserved_at(batch)
    activations = peak - model.fixed_bytes
    # Host memory (a CPU trainer's resident set) holds everything the process has: no CUDA
    # context outside the figure, the whole machine's memory to fit in.
    context = 0 if measured.get("memory") == "host" else CUDA_CONTEXT_BYTES
    checks: list[dict[str, Any]] = []
    for target in targets:
        limit = calibrated_limit(target.total_bytes) if context else target.total_bytes
        checks.append(
            {
                "name": target.name,
                "index": target.index,
                "source": target.source,
                "total_bytes": target.total_bytes,
                "usable_bytes": limit,
                "fits": reserved <= limit,
                "free_bytes": limit - reserved,
                "max_batch": model.largest_batch(limit),
            }
        )
    largest = min(int(c["max_batch"]) for c in checks)
    return {
        "parameters_count": None,
        "weights_bytes": measured.get("parameters_bytes"),
        "gradients_bytes": measured.get("gradients_bytes"),
        "optimizer_state_bytes": measured.get("optimizer_state_bytes"),
        "activations_bytes": activations,
        "overhead_bytes": reserved - peak + context,
        "total_bytes": reserved + context,
        "fits": all(c["fits"] for c in checks),
        "max_batch": largest,
        "targets": checks,
        "ways_to_fit": [],
        "calibration": {
            "source": source,
            **model.as_dict(),
            "measured": measured,
            "batch": batch,
            "peak_bytes": peak,
            "reserved_bytes": reserved,
            "first_failing_batch": largest + 1,
        },
    }


def calibrated_text(result: dict[str, Any]) -> str:
    cal = result["calibration"]
    measured = cal["measured"]
    b = format_bytes
    if measured.get("memory") == "host":
        return _calibrated_host_text(result)
    lines = [
        f"measured in {cal['source']} (pid {measured['pid']}, GPU {measured['device']}): "
        f"batch {cal['measured_batch']} peaked at {b(measured['peak_bytes'])} allocated, "
        f"{b(measured['reserved_bytes'])} reserved",
        f"  does not grow with the batch {b(cal['fixed_bytes'])} (weights "
        f"{b(measured['parameters_bytes'])}, optimizer state "
        f"{b(measured['optimizer_state_bytes'])}); activations "
        f"{b(cal['activation_bytes_per_sample'])} a sample; the cache reserves "
        f"{100 * cal['cache_share']:.0f} % of them again",
    ]
    for check in result["targets"]:
        verdict = "fits" if check["fits"] else "does not fit"
        lines.append(
            f"{check['name']}: batch {cal['batch']} → peak {b(cal['peak_bytes'])}, reserved "
            f"{b(cal['reserved_bytes'])}: {verdict} in {b(check['usable_bytes'])} usable "
            f"(all but the CUDA context); largest batch {check['max_batch']}"
        )
    return "\n".join(lines)


def _calibrated_host_text(result: dict[str, Any]) -> str:
    """A CPU trainer measured by its host memory: resident set, never "allocated" or a GPU."""
    cal = result["calibration"]
    measured = cal["measured"]
    b = format_bytes
    lines = [
        f"measured in {cal['source']} (pid {measured['pid']}, host memory: no CUDA device): "
        f"batch {cal['measured_batch']} peaked at {b(measured['peak_bytes'])} resident "
        f"(the kernel's high-water mark)",
        f"  does not grow with the batch {b(cal['fixed_bytes'])} (resident right after a step, "
        f"less what glibc keeps free); activations {b(cal['activation_bytes_per_sample'])} a "
        "sample",
    ]
    for check in result["targets"]:
        verdict = "fits" if check["fits"] else "does not fit"
        lines.append(
            f"{check['name']}: batch {cal['batch']} → peak {b(cal['peak_bytes'])} resident: "
            f"{verdict} in {b(check['usable_bytes'])}; largest batch {check['max_batch']}"
        )
    return "\n".join(lines)
