"""Bytes per GPU of one training setup: weights, gradients, optimizer state, activations and
what CUDA itself takes, and the largest micro-batch that fits.

The model states follow the ZeRO paper's accounting (Rajbhandari et al. 2020): stage 1
partitions the optimizer state (fp32 master weights included) over the data-parallel GPUs,
stage 2 the gradients too, stage 3 the parameters too.  Activations follow Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 1: per layer
s·b·h·(34 + 5·a·s/h) bytes in 16-bit (the 5·a·s/h term is the attention score matrices, which
fused attention - SDPA / FlashAttention, the default of PyTorch and transformers - never stores),
and 2·s·b·h per layer with full recomputation plus one layer's activations recomputed at a time.
Added to that: the logits and the loss's fp32 copies, which dominate at large vocabularies
and which the paper leaves out, and autocast's cache of 16-bit weight copies.
"""

from __future__ import annotations

import math
from dataclasses import field
from typing import Any

from memtop.base.records import record
from memtop.estimate.architecture import Architecture, ArchitectureError
from memtop.figures.units import MiB

DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}
# QLoRA's NF4 with double quantization: 4 bits + 8-bit absmax per 64 values + an fp32 second
# level constant per 256 blocks = 4.127 bits a parameter (Dettmers et al. 2023, §3).
QUANT_BYTES = {"4bit": (4 + 8 / 64 + 32 / (64 * 256)) / 8, "8bit": 1.0}
OPTIMIZERS = (
    "adamw",
    "adam",
    "adamw-8bit",
    "paged-adamw-8bit",
    "paged-adamw-32bit",
    "sgd",
    "sgd-momentum",
    "adafactor",
    "lion",
)
# bitsandbytes' paged optimizers keep their state in CUDA unified memory: under pressure the
# driver pages it out to CPU memory instead of failing (the QLoRA paper's paged optimizers).
PAGED_OPTIMIZERS = ("paged-adamw-8bit", "paged-adamw-32bit")
ATTENTION = ("sdpa", "eager")
CHECKPOINTING = ("none", "full")

CUDA_CONTEXT_BYTES = 512 * MiB  # the CUDA context and kernels of torch (lazy loading), measured
WORKSPACE_BYTES = 32 * MiB  # cuBLAS workspace of one stream on Hopper (4 MiB × 8)
NCCL_BYTES = 512 * MiB  # NCCL communicators and buffers when several GPUs train together
# What the driver and other libraries keep out of reach: memtop calls a setup that needs more
# than this share of the GPU "does not fit".
USABLE_SHARE = 0.95
# The caching allocator's reserved bytes above the allocated peak, as a share of the step's
# activations: 0.54 GB over 3.27 GB of activations on shared/traces/cuda-h100/healthy
# (reserved 5.66 GB for a 5.12 GB peak).  With it the 4-layer `oom` trainer's largest batch
# comes out 18 (the recording: 18 ran with one allocator retry, 23 failed).
CACHE_SHARE = 0.165
BNB_BLOCK = 2048  # bitsandbytes' 8-bit optimizers: one fp32 absmax per 2048 values per state
BNB_MIN_8BIT_SIZE = 4096  # ... and tensors of fewer values keep 32-bit states


@record(frozen=True, slots=True)
class Setup:
    """How the model is trained.  `batch` is the micro-batch per GPU."""

    dtype: str = "bf16"  # the trainable parameters (and so their gradients)
    optimizer: str = "adamw"
    master_weights: bool = False  # an fp32 copy of 16-bit trainable parameters
    autocast: bool = False  # fp32 parameters, 16-bit activations (torch.autocast)
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    quantize_base: str | None = None  # "4bit" (QLoRA) or "8bit"
    zero_stage: int = 0
    gpus: int = 1
    checkpointing: str = "none"
    attention: str = "sdpa"
    batch: int = 1
    seq: int = 2048
    context_bytes: int = CUDA_CONTEXT_BYTES
    adapter_dtype: str = "fp32"  # LoRA adapters (PEFT's default; the QLoRA paper's: bf16)
    offload_optimizer: bool = False  # optimizer state and master weights in CPU memory
    expert_parallel: int = 1  # GPUs the routed experts are split over (--ep)
    # Each expert's buffer holds capacity_factor × its even share of the routed tokens
    # (GShard, Switch Transformer); None: dropless routing (every token reaches its experts).
    capacity_factor: float | None = None

    def check(self) -> None:
        problems = []
        if self.dtype not in DTYPE_BYTES:
            problems.append(f"dtype must be one of {', '.join(DTYPE_BYTES)}")
        if self.adapter_dtype not in DTYPE_BYTES:
            problems.append(f"adapter dtype must be one of {', '.join(DTYPE_BYTES)}")
        if self.optimizer not in OPTIMIZERS:
            problems.append(f"optimizer must be one of {', '.join(OPTIMIZERS)}")
        if self.zero_stage not in (0, 1, 2, 3):
            problems.append("ZeRO stage must be 0, 1, 2 or 3")
        if self.gpus < 1:
            problems.append("GPU count must be at least 1")
        if self.batch < 1 or self.seq < 1:
            problems.append("batch and sequence length must be at least 1")
        if self.expert_parallel < 1:
            problems.append("expert parallelism must be at least 1")
        elif self.expert_parallel > self.gpus:
            problems.append("expert parallelism needs as many GPUs (--gpus) as --ep")
        if self.capacity_factor is not None and not 0 < self.capacity_factor <= 64:
            problems.append("capacity factor must be in (0, 64]")
        if self.lora_rank < 0:
            problems.append("LoRA rank must be >= 0")
        if self.quantize_base is not None and self.quantize_base not in QUANT_BYTES:
            problems.append(f"quantized base must be one of {', '.join(QUANT_BYTES)}")
        if self.quantize_base is not None and self.lora_rank == 0:
            problems.append("a quantized base trains only adapters: give a LoRA rank")
        if self.autocast and self.dtype != "fp32":
            problems.append("autocast keeps fp32 parameters: use --dtype fp32 with it")
        if self.checkpointing not in CHECKPOINTING:
            problems.append(f"checkpointing must be one of {', '.join(CHECKPOINTING)}")
        if self.attention not in ATTENTION:
            problems.append(f"attention must be one of {', '.join(ATTENTION)}")
        if problems:
            raise ArchitectureError("; ".join(problems))

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0


@record(frozen=True, slots=True)
class Estimate:
    """Bytes per GPU; `details` names the terms each part is made of."""

    arch: Architecture
    setup: Setup
    parameters_count: int
    trainable_parameters_count: int
    weights_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    overhead_bytes: int
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def model_states_bytes(self) -> int:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_state_bytes

    @property
    def total_bytes(self) -> int:
        return self.model_states_bytes + self.activations_bytes + self.overhead_bytes

    @property
    def required_bytes(self) -> int:
        """What must be on the GPU: a paged optimizer's state moves to CPU memory when the GPU
        is short (slower steps, not an OOM), so it is not required."""
        return self.total_bytes - int(self.details.get("paged_optimizer_bytes", 0))


def trainable_tensors(arch: Architecture, setup: Setup) -> list[tuple[tuple[int, ...], float]]:
    """(shape, how many) of every tensor the optimizer holds state for: the whole model, or
    the LoRA adapters A (rank × in) and B (out × rank) of each targeted matrix per layer."""
    if not setup.lora:
        return [(shape, n * arch.scale()) for shape, n in arch.parameter_tensors()]
    shapes, rank = arch.linear_shapes(), setup.lora_rank
    out: list[tuple[tuple[int, ...], float]] = []
    for target in setup.lora_targets:
        fan_in, fan_out = shapes[target]
        count = arch.layers * arch.scale()
        out += [((rank, fan_in), count), ((fan_out, rank), count)]
    return out


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def optimizer_state_bytes(arch: Architecture, setup: Setup, state_dtype_bytes: float) -> float:
    """Bytes of optimizer state (master weights apart), before ZeRO, as each optimizer allocates
    it for the trainable tensors.  `state_dtype_bytes`: the dtype of the parameters the
    optimizer steps (the fp32 master copy when there is one).  Checked against torch 2.13's
    optimizers in tests/test_estimate.py; torch keeps `step` as a CPU scalar (not counted)."""
    name = setup.optimizer
    tensors = trainable_tensors(arch, setup)
    numel = sum(_numel(shape) * n for shape, n in tensors)
    if name in ("adamw", "adam"):
        # exp_avg and exp_avg_sq: torch.zeros_like(param), so in the parameter's dtype (bf16
        # parameters: bf16 moments; fp32 moments only with fp32 parameters or master weights).
        return 2 * state_dtype_bytes * numel
    if name in ("sgd-momentum", "lion"):
        return state_dtype_bytes * numel  # one buffer like the parameter (momentum, exp_avg)
    if name == "sgd":
        return 0.0  # torch's SGD without momentum keeps no buffer
    if name in ("adamw-8bit", "paged-adamw-8bit"):
        # bitsandbytes' Optimizer2State: two uint8 states and one fp32 absmax per 2048-value
        # block of each (blockwise quantization); a tensor under min_8bit_size = 4096 values
        # keeps both states in fp32.  The quantization maps are shared, not per tensor.
        total = 0.0
        for shape, n in tensors:
            size = _numel(shape)
            if size < BNB_MIN_8BIT_SIZE:
                total += 8.0 * size * n
            else:
                total += (2.0 * size + 2 * 4 * math.ceil(size / BNB_BLOCK)) * n
        return total
    if name == "paged-adamw-32bit":
        return 8.0 * numel  # bitsandbytes' 32-bit states are fp32 whatever the parameter's dtype
    # torch.optim.Adafactor: a tensor of 2 or more dims keeps row_var (shape[:-1]) and col_var
    # (shape[:-2] + shape[-1:]), a vector its full variance, in the parameter's dtype.
    total = 0.0
    for shape, n in tensors:
        if len(shape) >= 2:
            total += (_numel(shape[:-1]) + _numel(shape[:-2]) * shape[-1]) * n
        else:
            total += _numel(shape) * n
    return state_dtype_bytes * total


def activation_parts(arch: Architecture, setup: Setup, batch: int) -> dict[str, int]:
    """Activation bytes of one micro-batch at the step's peak, by term (`layers` before the
    dtype factor)."""
    s, b, h, a, L = setup.seq, batch, arch.hidden, arch.heads, arch.layers
    sbh = s * b * h
    # Korthikanti et al. eq. 1, without the score matrices: 34·s·b·h a layer in 16 bits.  Under
    # autocast the residual stream stays fp32, so the two LayerNorms keep fp32 inputs: 4·s·b·h
    # more (the H100 recordings' peaks: 0.5 % off with it, 5 % without).
    per_layer_linear = (38 if setup.autocast else 34) * sbh
    if arch.moe:
        # A mixture of experts, by the same accounting: of the 34, 19 are the MLP's (its input
        # 2, its 4h-wide intermediate 16, a dropout mask 1).  An MoE layer keeps its input and
        # mask, a dispatched copy of the input per expert a token is sent to (2·k), and 4 bytes
        # a value of each active expert's intermediate (and the shared experts'), dropless
        # routing (every token reaches its k experts); with a capacity factor C every expert's
        # buffer is sized for C times its share, so the dispatched tokens count C·k.  Averaged
        # over the layers, dense ones keeping Korthikanti's 19.
        k, h_ = arch.experts_per_token * (setup.capacity_factor or 1.0), arch.hidden
        moe_mlp = 3 + 2 * k + 4 * (k * arch.expert_intermediate + arch.shared_intermediate) / h_
        mlp = (moe_mlp * arch.moe_layers + 19 * (L - arch.moe_layers)) / L
        per_layer_linear = round(((38 if setup.autocast else 34) - 19 + mlp) * sbh)
    scores = 5 * a * s * s * b if setup.attention == "eager" else 0
    per_layer = per_layer_linear + scores
    # With full recomputation each layer's input is kept (fp32 under autocast), and during the
    # backward one layer's activations are recomputed at a time.
    kept_input = (4 if setup.autocast else 2) * sbh
    layers = kept_input * L + per_layer if setup.checkpointing == "full" else per_layer * L
    # The loss's peak, at the start of the backward: the logits (16-bit, or fp32 in fp32
    # training), the fp32 log-softmax the loss saved, its gradient and the gradient of its
    # input, all of s·b·vocab values: 2 + 4 + 4 + 4 bytes (cross_entropy over logits.float()).
    logit_bytes = 4 if (DTYPE_BYTES[setup.dtype] == 4 and not setup.autocast) else 2
    logits = (logit_bytes + 12) * s * b * arch.vocab
    # `layers` includes the score matrices; they are named apart for the details.
    kept_scores = scores if setup.checkpointing == "full" else scores * L
    recomputed = per_layer if setup.checkpointing == "full" else 0
    return {
        "layers": layers,
        "attention_scores": kept_scores,
        "logits": logits,
        "recomputed_layer": recomputed,
    }


def estimate(arch: Architecture, setup: Setup) -> Estimate:
    setup.check()
    if setup.lora:
        targets = arch.resolve_targets(setup.lora_targets)
        setup = _with_targets(setup, targets)
    if setup.capacity_factor is not None and not arch.moe:
        raise ArchitectureError("--capacity-factor sizes experts' buffers: this model has none")
    n = setup.gpus
    total_params = arch.parameter_count()
    param_bytes = DTYPE_BYTES[setup.dtype]
    details: dict[str, Any] = {}

    if setup.lora:
        trainable = round(arch.lora_params(setup.lora_rank, setup.lora_targets) * arch.scale())
        # PEFT keeps adapters in fp32 (autocast_adapter_dtype) whatever the base's dtype; the
        # QLoRA paper's script casts them to bf16 (--adapter-dtype bf16).
        adapter_bytes = DTYPE_BYTES[setup.adapter_dtype]
        state_dtype_bytes = adapter_bytes
        if setup.quantize_base:
            quantized = arch.block_linear_params()
            rest = total_params - quantized
            base = quantized * QUANT_BYTES[setup.quantize_base] + rest * 2.0
            details["base_quantized_params"] = quantized
        else:
            base = total_params * param_bytes
        details["base_bytes"] = round(base)
        details["adapter_bytes"] = round(trainable * adapter_bytes)
        weights = base + trainable * adapter_bytes
        grads = trainable * adapter_bytes
        master = 0.0
    else:
        trainable = total_params
        weights = total_params * param_bytes
        grads = total_params * param_bytes
        master = 4.0 * total_params if setup.master_weights and param_bytes < 4 else 0.0
        # The optimizer steps the fp32 master copy when there is one (its moments are fp32).
        state_dtype_bytes = 4.0 if master else param_bytes

    state = optimizer_state_bytes(arch, setup, state_dtype_bytes)
    details["master_weights_bytes"] = round(master)
    details["optimizer_moments_bytes"] = round(state)
    optimizer = state + master
    if setup.expert_parallel > 1 and not setup.lora and setup.zero_stage < 1:
        optimizer *= _expert_share(arch, setup.expert_parallel, total_params)
    if setup.offload_optimizer:
        # DeepSpeed's offload_optimizer (ZeRO-Offload): state and master weights in CPU memory.
        details["offloaded_optimizer_bytes"] = round(optimizer)
        optimizer = 0.0

    if setup.expert_parallel > 1:
        # Expert parallelism: each GPU holds 1/ep of the routed experts, and their gradients
        # and optimizer state; attention, shared experts and embeddings stay replicated.  What
        # ZeRO partitions over all the GPUs below is 1/gpus of everything either way.
        kept = _expert_share(arch, setup.expert_parallel, total_params)
        details["expert_parallel_share"] = round(kept, 6)
        if setup.zero_stage < 3:
            weights *= kept
        if not setup.lora and setup.zero_stage < 2:
            grads *= kept

    # ZeRO partitions model states over the data-parallel GPUs.
    if setup.zero_stage >= 1:
        optimizer /= n
    if setup.zero_stage >= 2:
        grads /= n
    if setup.zero_stage >= 3:
        weights /= n

    parts = activation_parts(arch, setup, setup.batch)
    act_factor = 1.0 if (param_bytes < 4 or setup.autocast) else 2.0  # fp32 activations
    activations = parts["layers"] * act_factor + parts["logits"]
    cast_cache = 0
    if setup.autocast:
        # autocast keeps a 16-bit copy of every weight it casts until the forward ends.
        cast_cache = 2 * round(arch.block_linear_params() + arch.head_params() * arch.scale())
        activations += cast_cache
    details["activation_layers_bytes"] = round(parts["layers"] * act_factor)
    details["activation_scores_bytes"] = round(parts["attention_scores"] * act_factor)
    # Full recomputation: Korthikanti's 2·s·b·h·L plus this one layer recomputed in backward.
    details["activation_recomputed_layer_bytes"] = round(parts["recomputed_layer"] * act_factor)
    details["logits_bytes"] = parts["logits"]
    details["autocast_cache_bytes"] = cast_cache

    # The caching allocator reserves more than the peak it serves: blocks freed by one phase
    # of the step are split or cached at sizes the next cannot use.  It grows with the
    # transient tensors, not with the model states (allocated once).
    cache = round(CACHE_SHARE * activations)
    details["allocator_cache_bytes"] = cache
    overhead = setup.context_bytes + WORKSPACE_BYTES + cache
    if n > 1:
        overhead += NCCL_BYTES
    if setup.zero_stage == 3:
        # The largest module is gathered whole (DeepSpeed counts 4 bytes a parameter for it).
        gather = 4 * arch.largest_layer_params()
        overhead += gather
        details["zero3_gather_bytes"] = gather
    details["lora_targets"] = list(setup.lora_targets)
    details["paged_optimizer_bytes"] = (
        round(optimizer) if setup.optimizer in PAGED_OPTIMIZERS else 0
    )

    return Estimate(
        arch=arch,
        setup=setup,
        parameters_count=total_params,
        trainable_parameters_count=trainable,
        weights_bytes=round(weights),
        gradients_bytes=round(grads),
        optimizer_state_bytes=round(optimizer),
        activations_bytes=round(activations),
        overhead_bytes=round(overhead),
        details=details,
    )


def _expert_share(arch: Architecture, ep: int, total_params: int) -> float:
    """The share of the model one GPU holds when the routed experts are split over `ep`."""
    if not arch.moe:
        raise ArchitectureError("--ep splits experts: this model has none")
    if arch.experts % ep:
        raise ArchitectureError(f"--ep {ep} does not divide the {arch.experts} experts")
    routed = arch.moe_layers * arch.experts * arch.expert_params() * arch.scale()
    return 1 - (routed / total_params) * (1 - 1 / ep)


def _with_targets(setup: Setup, targets: tuple[str, ...]) -> Setup:
    from dataclasses import replace

    return replace(setup, lora_targets=targets)


def usable_bytes(capacity: int) -> int:
    return int(capacity * USABLE_SHARE)


def max_batch(arch: Architecture, setup: Setup, capacity: int) -> int:
    """The largest micro-batch whose estimate fits in `capacity` bytes (0: not even one)."""
    from dataclasses import replace

    one = estimate(arch, replace(setup, batch=1))
    two = estimate(arch, replace(setup, batch=2))
    per_sample = two.required_bytes - one.required_bytes
    fixed = one.required_bytes - per_sample
    room = usable_bytes(capacity) - fixed
    if room < per_sample:
        return 0
    return int(room // per_sample) if per_sample > 0 else 1 << 20


def recipe(setup: Setup) -> str:
    """The precision recipe in words: what the table counts, never left to be assumed."""
    moments = {
        "adamw": "Adam moments",
        "adam": "Adam moments",
        "sgd-momentum": "momentum",
        "lion": "Lion moment",
        "adafactor": "Adafactor factors",
    }.get(setup.optimizer)
    if setup.lora:
        base = (
            f"a {setup.quantize_base} quantized base" if setup.quantize_base else
            f"a frozen {setup.dtype} base"
        )  # fmt: skip
        return f"adapters: {base}, {setup.adapter_dtype} LoRA adapters, their gradients and state"
    if setup.autocast:
        return (
            "mixed precision (torch.autocast, HF bf16=True): fp32 weights, gradients and "
            f"{moments or 'optimizer state'}, 16-bit activations and a 16-bit weight cache"
        )
    if setup.dtype == "fp32":
        return f"full fp32: fp32 weights, gradients, {moments or 'optimizer state'} and activations"
    state = f"fp32 {moments}" if moments else f"{setup.optimizer} state"
    if setup.master_weights:
        return (
            f"mixed precision with a master copy: {setup.dtype} weights and gradients, fp32 "
            f"master weights and {state} (DeepSpeed, Megatron)"
        )
    state = moments or f"{setup.optimizer} state"
    return f"pure {setup.dtype}: {setup.dtype} weights, gradients and {state}, no fp32 master copy"


def mixed_precision_default(setup: Setup) -> Setup | None:
    """The common recipe (fp32 weights under bf16 autocast, what HF `bf16=True` runs) when
    `setup` is pure 16-bit training; None when it already keeps fp32 state."""
    if setup.lora or setup.autocast or setup.master_weights or DTYPE_BYTES[setup.dtype] == 4:
        return None
    from dataclasses import replace

    return replace(setup, dtype="fp32", autocast=True)
