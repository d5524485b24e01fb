"""The estimate as a table for people and as one JSON object (DESIGN §11: `weights_bytes`,
`gradients_bytes`, `optimizer_state_bytes`, `activations_bytes`, `overhead_bytes`,
`total_bytes`, `parameters_count`, `fits`, `max_batch`; sizes are integer bytes per GPU)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from memtop.base.records import record
from memtop.estimate.architecture import Architecture
from memtop.estimate.calibrate import BatchModel
from memtop.estimate.fit import ways_to_fit
from memtop.estimate.memory import (
    CUDA_CONTEXT_BYTES,
    USABLE_SHARE,
    Estimate,
    Setup,
    estimate,
    max_batch,
    mixed_precision_default,
    recipe,
    usable_bytes,
)
from memtop.estimate.reference import deepspeed_zero2_gpu_bytes, deepspeed_zero3_gpu_bytes
from memtop.estimate.serving import (
    ServeEstimate,
    kv_heads_per_gpu,
    ways_to_serve,
    weights_in_words,
)
from memtop.estimate.serving import verdict as serve_verdict
from memtop.figures.units import format_bytes


@record(frozen=True, slots=True)
class Target:
    """A GPU to fit in: a named one, or one of this machine's (source "nvml", "amdsmi"), whose
    memory free now (`free_now_bytes`) is what a run started now gets."""

    name: str
    total_bytes: int
    source: str  # "named" | "nvml" | "amdsmi" | ...
    index: int | None = None
    free_now_bytes: int | None = None

    @property
    def capacity_bytes(self) -> int:
        """The capacity to fit in: the board's total, or, for a GPU of this machine, no more
        than is free on it now (so that its usable share is at most the free memory)."""
        if self.free_now_bytes is None:
            return self.total_bytes
        return min(self.total_bytes, int(self.free_now_bytes / USABLE_SHARE))

    def describe(self) -> str:
        where = self.name + (f" (GPU {self.index})" if self.index is not None else "")
        if self.free_now_bytes is None:
            return where
        return (
            f"{where}, {format_bytes(self.free_now_bytes)} free now of "
            f"{format_bytes(self.total_bytes)}"
        )


def _target_fields(target: Target) -> dict[str, Any]:
    return {
        "name": target.name,
        "index": target.index,
        "source": target.source,
        "total_bytes": target.total_bytes,
        "free_now_bytes": target.free_now_bytes,
    }


def verdicts(est: Estimate, targets: list[Target]) -> list[dict[str, Any]]:
    out = []
    for target in targets:
        usable = usable_bytes(target.capacity_bytes)
        out.append(
            {
                **_target_fields(target),
                "usable_bytes": usable,
                "fits": est.required_bytes <= usable,
                "free_bytes": usable - est.required_bytes,
                "max_batch": max_batch(est.arch, est.setup, target.capacity_bytes),
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
    mixed = mixed_precision_default(est.setup)
    return {
        "model": est.arch.as_dict(),
        "setup": setup,
        "mode": "train",
        "recipe": recipe(est.setup),
        # The common recipe's figure when this one is pure 16-bit (None otherwise).
        "mixed_precision": _mixed(est, mixed),
        **moe_fields(est.arch),
        "trainable_parameters_count": est.trainable_parameters_count,
        "weights_bytes": est.weights_bytes,
        "gradients_bytes": est.gradients_bytes,
        "optimizer_state_bytes": est.optimizer_state_bytes,
        "activations_bytes": est.activations_bytes,
        "overhead_bytes": est.overhead_bytes,
        # overhead_bytes, split: the CUDA context and buffers, and the caching allocator's
        # reserve above the peak it serves.
        "context_bytes": est.overhead_bytes - int(est.details.get("allocator_cache_bytes", 0)),
        "allocator_reserve_bytes": int(est.details.get("allocator_cache_bytes", 0)),
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
    return ways_to_fit(est.arch, est.setup, targets[0].capacity_bytes)


def moe_fields(arch: Architecture) -> dict[str, Any]:
    """parameters_count and, for a mixture of experts, what a token runs through (DESIGN §13)."""
    out: dict[str, Any] = {
        "parameters_count": arch.parameter_count(),
        "active_parameters_count": arch.active_parameter_count(),
        "experts": None,
    }
    if arch.moe:
        out["experts"] = {
            "routed": arch.experts,
            "per_token": arch.experts_per_token,
            "expert_intermediate": arch.expert_intermediate,
            "shared_intermediate": arch.shared_intermediate,
            "moe_layers": arch.moe_layers,
            "dense_layers": arch.layers - arch.moe_layers,
            # The count without the input embedding table (a token reads one row of it):
            # DeepSeek-V3's 36.6 B and gpt-oss's 5.1 B "active" are counted so.
            "active_without_input_embedding": arch.active_parameter_count()
            - round(arch.vocab * arch.hidden * arch.scale()),
        }
    if arch.mtp_layers:
        out["mtp_parameters_count"] = arch.mtp_parameter_count()
    return out


def _mixed(est: Estimate, mixed: Setup | None) -> dict[str, Any] | None:
    if mixed is None:
        return None
    other = estimate(est.arch, mixed)
    return {
        "change": "--autocast",
        "recipe": recipe(mixed),
        "total_bytes": other.total_bytes,
    }


def moe_line(arch: Architecture) -> str:
    """'; 12.9 B active per token (2 of 8 experts in 32 layers)' for a mixture of experts."""
    if not arch.moe:
        return ""
    shared = ", and the shared experts" if arch.shared_intermediate else ""
    dense = arch.layers - arch.moe_layers
    layers = f"{arch.moe_layers} layers" + (f"; {dense} dense" if dense else "")
    return (
        f" ({arch.active_parameter_count() / 1e9:.3f} B active per token: "
        f"{arch.experts_per_token} of {arch.experts} experts{shared} in {layers})"
    )


def mtp_line(arch: Architecture) -> str | None:
    if not arch.mtp_layers:
        return None
    return (
        f"  not counted: {arch.mtp_parameter_count() / 1e9:.3f} B in {arch.mtp_layers} "
        "multi-token-prediction module(s) (the checkpoint has them; transformers does not load "
        "them; an engine using them for speculative decoding does)"
    )


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
    if setup.expert_parallel > 1:
        parts.append(f"experts over {setup.expert_parallel} GPUs")
    if arch.moe:
        cf = setup.capacity_factor
        parts.append("dropless routing" if cf is None else f"capacity factor {cf:g}")
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
        f"{arch.name}: {est.parameters_count / 1e9:.3f} B parameters{moe_line(arch)}"
        f"{trainable}; {shape}",
        _describe_setup(arch, setup),
        f"recipe: {recipe(setup)}",
    ]
    mtp = mtp_line(arch)
    if mtp:
        lines.append(mtp)
    lines += ["", f"{'per GPU':<20}{'bytes':>12}"]
    reserve = int(est.details.get("allocator_cache_bytes", 0))
    rows = [
        ("weights", est.weights_bytes),
        ("gradients", est.gradients_bytes),
        ("optimizer state", est.optimizer_state_bytes),
        ("activations", est.activations_bytes),
        ("CUDA context", est.overhead_bytes - reserve),
        ("allocator reserve", reserve),
    ]
    lines += [f"  {name:<18}{format_bytes(value):>12}" for name, value in rows]
    lines.append(f"  {'total':<18}{format_bytes(est.total_bytes):>12}")
    held = ["the CUDA context and kernels", "cuBLAS's workspace"]
    if setup.gpus > 1:
        held.append("NCCL's buffers")
    if "zero3_gather_bytes" in est.details:
        held.append("ZeRO-3's gathered layer")
    lines.append(
        f"  CUDA context: {', '.join(held)}; allocator reserve: what torch's caching allocator "
        "holds above the peak it serves (blocks cached at sizes the next phase cannot use)"
    )
    mixed = _mixed(est, mixed_precision_default(setup))
    if mixed is not None:
        lines.append(
            f"  the common recipe, {mixed['recipe']}, would need "
            f"{format_bytes(mixed['total_bytes'])}: add --autocast"
        )
    if setup.checkpointing == "full":
        lines.append(
            "  activations with full recomputation: each layer's input kept (2·s·b·h·L, "
            "Korthikanti et al. 2022) plus one layer's activations recomputed in the backward "
            f"({format_bytes(est.details.get('activation_recomputed_layer_bytes', 0))}), "
            "which the paper's figure leaves out"
        )
    for name, value in reference(est).items():
        function, fixed_recipe = DEEPSPEED_NOTES[name]
        lines.append(
            f"  DeepSpeed's {function}: {format_bytes(value)} of model states per GPU for its "
            f"fixed recipe ({fixed_recipe}); the table above counts this setup "
            f"({format_bytes(est.model_states_bytes)} of model states: {_this_setup_states(est)})"
        )
    for target, check in zip(targets, verdicts(est, targets), strict=True):
        where = target.describe()
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
        f"measured in {cal['source']} (pid {measured['pid']}, GPU {measured['device']}"
        f"{_steps_used(measured)}): "
        f"batch {cal['measured_batch']} peaked at {b(measured['peak_bytes'])} allocated, "
        f"{b(measured['reserved_bytes'])} reserved",
        f"  leak: {measured.get('leak') or 'not judged'}",
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


def _steps_used(measured: dict[str, Any]) -> str:
    first, last = measured.get("first_step"), measured.get("last_step")
    if first is None or last is None:
        return ", no step marks"
    return f", steps {first}-{last}, {measured.get('steps')} marks"


def _calibrated_host_text(result: dict[str, Any]) -> str:
    """A CPU trainer measured by its host memory: resident set, never "allocated" or a GPU."""
    cal = result["calibration"]
    measured = cal["measured"]
    b = format_bytes
    lines = [
        f"measured in {cal['source']} (pid {measured['pid']}, host memory: no CUDA device"
        f"{_steps_used(measured)}): "
        f"batch {cal['measured_batch']} peaked at {b(measured['peak_bytes'])} resident "
        f"(the kernel's high-water mark)",
        f"  leak: {measured.get('leak') or 'not judged'}",
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


# -- --serve: generation ----------------------------------------------------------------------


def serve_recipe(est: ServeEstimate) -> str:
    setup = est.setup
    parts = [
        f"serving: {weights_in_words(setup.weights)}",
        f"{setup.kv_dtype} KV cache",
        f"{setup.concurrency} sequence{'s' if setup.concurrency != 1 else ''} of "
        f"{setup.context} tokens",
    ]
    if setup.tp > 1:
        parts.append(f"tensor parallel over {setup.tp} GPUs (per GPU below)")
    if setup.offload_layers:
        parts.append(f"{setup.offload_layers} layers' weights in CPU memory")
    return ", ".join(parts)


def serve_checks(est: ServeEstimate, targets: list[Target]) -> list[dict[str, Any]]:
    return [{**_target_fields(t), **serve_verdict(est, t.capacity_bytes)} for t in targets]


def serve_json(est: ServeEstimate, targets: list[Target]) -> dict[str, Any]:
    checks = serve_checks(est, targets)
    return {
        "model": est.arch.as_dict(),
        "setup": asdict(est.setup),
        "mode": "serve",
        "recipe": serve_recipe(est),
        **moe_fields(est.arch),
        "weights_bytes": est.weights_bytes,
        "gradients_bytes": 0,
        "optimizer_state_bytes": 0,
        "kv_cache_bytes": est.kv_cache_bytes,
        "kv_bytes_per_token": est.kv_bytes_per_token,
        "activations_bytes": est.activations_bytes,
        "overhead_bytes": est.overhead_bytes,
        "context_bytes": est.context_bytes,
        "allocator_reserve_bytes": est.allocator_reserve_bytes,
        "total_bytes": est.total_bytes,
        "details": est.details,
        "fits": all(c["fits"] for c in checks) if checks else None,
        "max_batch": None,
        "max_concurrency": min(c["max_concurrency"] for c in checks) if checks else None,
        "max_context": min(c["max_context"] for c in checks) if checks else None,
        "targets": checks,
        "ways_to_fit": (
            ways_to_serve(est.arch, est.setup, targets[0].capacity_bytes) if targets else []
        ),
    }


def serve_text(est: ServeEstimate, targets: list[Target]) -> str:
    arch, setup = est.arch, est.setup
    b = format_bytes
    lines = [
        f"{arch.name}: {arch.parameter_count() / 1e9:.3f} B parameters{moe_line(arch)}; "
        f"{arch.layers} layers, "
        + (
            f"latent attention (a {arch.kv_lora_rank}-wide latent)"
            if arch.mla
            else f"{kv_heads_per_gpu(arch, 1)} KV heads"
        ),
        f"recipe: {serve_recipe(est)}",
    ]
    mtp = mtp_line(arch)
    if mtp:
        lines.append(mtp)
    lines += ["", f"{'per GPU':<20}{'bytes':>12}"]
    rows = [
        ("weights", est.weights_bytes),
        ("KV cache", est.kv_cache_bytes),
        ("prefill", est.activations_bytes),
        ("CUDA context", est.context_bytes),
        ("allocator reserve", est.allocator_reserve_bytes),
    ]
    lines += [f"  {name:<18}{b(value):>12}" for name, value in rows]
    lines.append(f"  {'total':<18}{b(est.total_bytes):>12}")
    window = (
        f"; {arch.sliding_layers} sliding-window layers keep at most {arch.sliding_window} tokens"
        if arch.sliding_layers
        else ""
    )
    lines.append(
        f"  KV cache: {b(est.kv_bytes_per_token)} a token ({arch.layers} layers × "
        + (
            f"(latent {arch.kv_lora_rank} + rotary key {arch.qk_rope_head_dim})"
            if arch.mla
            else f"2 × {kv_heads_per_gpu(arch, setup.tp)} KV heads × {arch.attention_head_dim()}"
        )
        + f" × {setup.kv_dtype}){window}; prefill: the largest forward pass, "
        f"{est.details['prefill_tokens']} tokens one layer at a time, and the last tokens' logits"
    )
    offloaded = int(est.details.get("offloaded_weights_bytes", 0))
    if offloaded:
        lines.append(
            f"  {b(offloaded)} of weights in CPU memory, streamed over PCIe for every token"
        )
    for target, check in zip(targets, serve_checks(est, targets), strict=True):
        room = b(abs(check["free_bytes"]))
        if check["fits"]:
            verdict = f"fits, {room} to spare"
        else:
            verdict = f"does not fit: {room} over the usable {b(check['usable_bytes'])}"
            if est.fixed_bytes > check["usable_bytes"]:
                verdict += (
                    f" (the weights alone are {b(est.weights_bytes)}, before any KV cache)"
                    if est.weights_bytes > check["usable_bytes"]
                    else f" (all but the KV cache is {b(est.fixed_bytes)})"
                )
        if check["max_context"] == 0:
            limits = "no room left for a KV cache"
        else:
            limits = (
                f"at {setup.context} tokens at most {check['max_concurrency']} sequences at "
                f"once; for {setup.concurrency} sequence{'s' if setup.concurrency != 1 else ''} "
                f"at most {check['max_context']} tokens each"
            )
        lines.append(f"{target.describe()}: {verdict}; {limits}")
        vllm = check.get("vllm")
        if vllm:
            lines.append(
                f"  vLLM at --gpu-memory-utilization {vllm['gpu_memory_utilization']}: "
                f"{b(vllm['kv_cache_bytes'])} of KV cache ({vllm['kv_cache_tokens']} tokens); "
                f"it would report a maximum concurrency of {vllm['max_concurrency']}x for "
                f"{setup.context} tokens per request"
            )
    if targets:
        found = ways_to_serve(arch, setup, targets[0].capacity_bytes)
        if found:
            lines.append(f"Ways to fit in {targets[0].name}:")
            for way in found:
                lines.append(
                    f"  {way['change']}: {b(way['total_bytes'])}; {way['what']}; "
                    f"costs: {way['cost']}"
                )
        elif not serve_checks(est, targets[:1])[0]["fits"]:
            lines.append(f"no single change makes it fit in {targets[0].name}")
    return "\n".join(lines)
