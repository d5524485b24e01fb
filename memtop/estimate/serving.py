"""Bytes per GPU of serving a model for generation (`memtop estimate --serve`): its weights in
their dtype or quantized, the KV cache of every sequence at its context, the largest prefill's
working tensors, and what CUDA itself takes; then the most sequences at a context and the
longest context at a concurrency that fit, and what a vLLM-style memory budget leaves.

The KV cache: every layer keeps a key and a value per token per KV head, 2 · layers · kv heads
· head dim · bytes a token (Llama-2-70B in fp16: 2 · 80 · 8 · 128 · 2 = 320 KiB).  Grouped-query
and multi-query attention need only the KV heads; DeepSeek's latent attention keeps one
compressed latent and one rotary key a token per layer, (kv_lora_rank + qk_rope_head_dim) ·
bytes, the same on every tensor-parallel GPU (vLLM's MLA backend); a sliding-window layer
keeps at most its window.  Tensor parallelism splits the weights and the KV heads (a KV head
is replicated when there are more GPUs than KV heads, as vLLM does).

vLLM sizes its cache from a budget: `gpu_memory_utilization` × the GPU's memory, less the
weights, the profile run's peak activations and what is outside torch (the worker's
`determine_num_available_blocks`); the concurrency it reports at start-up is the cache's
tokens over `max_model_len` ("Maximum concurrency for N tokens per request: X").  Pure
arithmetic: no I/O.
"""

from __future__ import annotations

import math
import re
from dataclasses import field
from typing import Any

from memtop.base.records import record
from memtop.estimate.architecture import LLAMA, Architecture, ArchitectureError
from memtop.estimate.memory import (
    CACHE_SHARE,
    CUDA_CONTEXT_BYTES,
    NCCL_BYTES,
    QUANT_BYTES,
    WORKSPACE_BYTES,
    usable_bytes,
)

# Bytes a value of the KV cache and of unquantized weights.
KV_DTYPES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
WEIGHT_DTYPES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}
# GPTQ and AWQ: `bits` a weight, and per group of `group_size` weights of a column an fp16 scale
# and a zero point packed at `bits` (the qzeros tensor): bits/8 + (2 + bits/8)/group bytes.
_GROUPED = re.compile(r"^(gptq|awq)-(\d)bit(?:-g(\d+))?$")
# MXFP4 (gpt-oss's experts): 4-bit values and one 8-bit scale per 32 (the OCP MX format).
MXFP4_BYTES = (4 + 8 / 32) / 8
# FP8 with one fp32 scale per 128 × 128 block (DeepSeek-V3's checkpoint).
FP8_BLOCK_BYTES = 1 + 4 / (128 * 128)
# A PCIe 4.0 x16 link's practical host-to-device rate: what each generated token waits for
# the weights of the layers offloaded to CPU memory.
PCIE_BYTES_PER_S = 25e9
GPU_COUNTS = (2, 4, 8, 16)


@record(frozen=True, slots=True)
class ServeSetup:
    """How the model is served.  `context`: tokens a sequence holds (prompt and output);
    `concurrency`: sequences at once; `prefill_tokens`: the most tokens one forward pass takes
    (the whole prompt without chunked prefill)."""

    weights: str = "bf16"  # fp32 | bf16 | fp16 | 4bit | 8bit | fp8 | mxfp4 | gptq-4bit-g128 ...
    kv_dtype: str = "bf16"
    context: int = 2048
    concurrency: int = 1
    tp: int = 1
    prefill_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    offload_layers: int = 0  # layers whose weights stay in CPU memory

    def check(self, arch: Architecture) -> None:
        problems = []
        if self.kv_dtype not in KV_DTYPES:
            problems.append(f"KV cache dtype must be one of {', '.join(KV_DTYPES)}")
        try:
            quantized_bytes(self.weights)
        except ValueError as exc:
            problems.append(str(exc))
        if self.context < 1 or self.concurrency < 1:
            problems.append("context and concurrency must be at least 1")
        if self.tp < 1:
            problems.append("tensor parallelism must be at least 1")
        if self.prefill_tokens is not None and self.prefill_tokens < 1:
            problems.append("prefill tokens must be at least 1")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            problems.append("--gpu-memory-utilization must be in (0, 1]")
        if not 0 <= self.offload_layers <= arch.layers:
            problems.append(f"offloaded layers must be between 0 and the {arch.layers} layers")
        if arch.assumed:
            problems.append(
                "serving needs the model's attention shape (KV heads, head size): give "
                "--preset or --config, not --params"
            )
        if problems:
            raise ArchitectureError("; ".join(problems))


def quantized_bytes(weights: str) -> float | None:
    """Bytes a quantized weight of the blocks' matrices, or None for an unquantized dtype."""
    if weights in WEIGHT_DTYPES:
        return None
    if weights in QUANT_BYTES:  # bitsandbytes: NF4 with double quantization, LLM.int8
        return QUANT_BYTES[weights]
    if weights == "fp8":
        return FP8_BLOCK_BYTES
    if weights == "mxfp4":
        return MXFP4_BYTES
    grouped = _GROUPED.match(weights)
    if grouped:
        bits, group = int(grouped.group(2)), int(grouped.group(3) or 128)
        if bits not in (2, 3, 4, 8) or group < 1:
            raise ValueError(f"weights {weights!r}: GPTQ/AWQ take 2, 3, 4 or 8 bits, a group >= 1")
        return bits / 8 + (2 + bits / 8) / group
    raise ValueError(
        f"weights {weights!r}: use fp32, bf16, fp16, 4bit, 8bit, fp8, mxfp4 or "
        "gptq-4bit-g128 / awq-4bit-g128"
    )


def weights_in_words(weights: str) -> str:
    words = {
        "fp32": "fp32 weights",
        "bf16": "bf16 weights",
        "fp16": "fp16 weights",
        "4bit": "4-bit NF4 weights (bitsandbytes, double quantization)",
        "8bit": "8-bit weights (bitsandbytes LLM.int8)",
        "fp8": "fp8 weights with 128×128 block scales",
        "mxfp4": "MXFP4 experts (4 bits and a scale per 32), the rest bf16",
    }
    if weights in words:
        return words[weights]
    grouped = _GROUPED.match(weights)
    assert grouped is not None
    method, bits, group = grouped.group(1).upper(), grouped.group(2), grouped.group(3) or "128"
    return f"{method} {bits}-bit weights in groups of {group}"


# -- the KV cache -----------------------------------------------------------------------------


def kv_heads_per_gpu(arch: Architecture, tp: int) -> int:
    kv = arch.kv_heads if arch.family == LLAMA else arch.heads
    return max(1, math.ceil(kv / tp))


def kv_layer_bytes_per_token(arch: Architecture, setup: ServeSetup) -> float:
    """One layer's KV cache bytes for one token, on one GPU."""
    value = KV_DTYPES[setup.kv_dtype]
    if arch.mla:
        return (arch.kv_lora_rank + arch.qk_rope_head_dim) * value
    return 2 * kv_heads_per_gpu(arch, setup.tp) * arch.attention_head_dim() * value


def kv_bytes_per_token(arch: Architecture, setup: ServeSetup) -> int:
    """Every layer's KV cache for one token (sliding-window layers as if the window were not
    yet full): the figure "KV cache per token" means."""
    return round(arch.layers * kv_layer_bytes_per_token(arch, setup))


def kv_cache_bytes(arch: Architecture, setup: ServeSetup, context: int, sequences: int) -> int:
    """The KV cache of `sequences` sequences of `context` tokens, on one GPU."""
    per_layer = kv_layer_bytes_per_token(arch, setup)
    full = arch.layers - arch.sliding_layers
    window = min(context, arch.sliding_window) if arch.sliding_layers else 0
    tokens = full * context + arch.sliding_layers * window
    return round(per_layer * tokens * sequences)


# -- weights and activations ------------------------------------------------------------------


def weight_bytes(arch: Architecture, setup: ServeSetup) -> dict[str, int]:
    """The weights on one GPU: quantized matrices of the blocks (all of them, or the experts
    only for MXFP4), the rest (embeddings, head, norms, biases) in 16 bits; split over the
    tensor-parallel GPUs."""
    total = arch.parameter_count()
    per_value = quantized_bytes(setup.weights)
    if per_value is None:
        on_all = total * WEIGHT_DTYPES[setup.weights]
        quantized = 0
    else:
        if setup.weights == "mxfp4":
            quantized = round(arch.moe_layers * arch.experts * 3 * arch.hidden
                              * arch.expert_intermediate * arch.scale())  # fmt: skip
            if not quantized:
                raise ArchitectureError("MXFP4 weights quantize experts: this model has none")
        else:
            quantized = arch.block_linear_params()
        on_all = quantized * per_value + (total - quantized) * 2.0
    per_gpu = on_all / setup.tp
    offloaded = per_gpu * setup.offload_layers / arch.layers if setup.offload_layers else 0.0
    return {
        "weights_bytes": round(per_gpu - offloaded),
        "offloaded_weights_bytes": round(offloaded),
        "quantized_params": quantized,
    }


def prefill_bytes(arch: Architecture, setup: ServeSetup) -> dict[str, int]:
    """The largest forward pass's working tensors, one layer at a time (nothing is kept for a
    backward): the residual stream and its normed copy, q/k/v and the attention's output,
    the MLP's gate, up and activated values (the k experts a token is sent to, and the shared
    ones), in 16 bits; and the fp32 logits of each sequence's last token."""
    tokens = min(setup.context, setup.prefill_tokens or setup.context)
    d = arch.attention_head_dim()
    q = arch.heads * (arch.qk_nope_head_dim + arch.qk_rope_head_dim if arch.mla else d)
    kv = (
        2 * kv_heads_per_gpu(arch, 1) * d
        if not arch.mla
        else arch.heads * (arch.qk_nope_head_dim + arch.v_head_dim)
    )
    if arch.moe:
        inter = arch.experts_per_token * arch.expert_intermediate + arch.shared_intermediate
        inter = max(inter, arch.intermediate if arch.moe_layers < arch.layers else 0)
    else:
        inter = arch.intermediate
    per_token = (2 * arch.hidden + q + kv + arch.heads * d + 3 * inter) * 2.0 / setup.tp
    logits = setup.concurrency * arch.vocab * 4
    return {
        "prefill_tokens": tokens,
        "activation_bytes_per_token": round(per_token),
        "activations_bytes": round(per_token * tokens) + logits,
    }


@record(frozen=True, slots=True)
class ServeEstimate:
    arch: Architecture
    setup: ServeSetup
    weights_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_token: int
    activations_bytes: int
    context_bytes: int  # the CUDA context, cuBLAS workspace, NCCL when tp > 1
    allocator_reserve_bytes: int
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def overhead_bytes(self) -> int:
        return self.context_bytes + self.allocator_reserve_bytes

    @property
    def fixed_bytes(self) -> int:
        """All but the KV cache."""
        return self.weights_bytes + self.activations_bytes + self.overhead_bytes

    @property
    def total_bytes(self) -> int:
        return self.fixed_bytes + self.kv_cache_bytes


def serve_estimate(arch: Architecture, setup: ServeSetup) -> ServeEstimate:
    setup.check(arch)
    weights = weight_bytes(arch, setup)
    prefill = prefill_bytes(arch, setup)
    context = CUDA_CONTEXT_BYTES + WORKSPACE_BYTES + (NCCL_BYTES if setup.tp > 1 else 0)
    reserve = round(CACHE_SHARE * prefill["activations_bytes"])
    details: dict[str, Any] = {**weights, **prefill}
    details.pop("weights_bytes")
    details.pop("activations_bytes")
    return ServeEstimate(
        arch=arch,
        setup=setup,
        weights_bytes=weights["weights_bytes"],
        kv_cache_bytes=kv_cache_bytes(arch, setup, setup.context, setup.concurrency),
        kv_bytes_per_token=kv_bytes_per_token(arch, setup),
        activations_bytes=prefill["activations_bytes"],
        context_bytes=context,
        allocator_reserve_bytes=reserve,
        details=details,
    )


def max_concurrency(est: ServeEstimate, room: int) -> int:
    """The most sequences of the setup's context whose KV cache fits in `room` bytes."""
    one = kv_cache_bytes(est.arch, est.setup, est.setup.context, 1)
    return max(0, int(room // one)) if one > 0 else 0


def max_context(est: ServeEstimate, room: int) -> int:
    """The longest context whose KV cache for the setup's concurrency fits in `room` bytes."""
    arch, setup = est.arch, est.setup
    if kv_cache_bytes(arch, setup, 1, setup.concurrency) > room:
        return 0
    low, high = 1, 1 << 40
    while low < high:  # the cache only grows with the context: the largest that fits
        mid = (low + high + 1) // 2
        if kv_cache_bytes(arch, setup, mid, setup.concurrency) <= room:
            low = mid
        else:
            high = mid - 1
    return low


def verdict(est: ServeEstimate, capacity: int) -> dict[str, Any]:
    """Fit in one GPU of `capacity` bytes (its usable share); with a vLLM budget, what that
    budget leaves for the KV cache and the concurrency vLLM would report."""
    usable = usable_bytes(capacity)
    room = usable - est.fixed_bytes
    out: dict[str, Any] = {
        "usable_bytes": usable,
        "fits": est.total_bytes <= usable,
        "free_bytes": usable - est.total_bytes,
        "max_concurrency": max_concurrency(est, room) if room > 0 else 0,
        "max_context": max_context(est, room) if room > 0 else 0,
    }
    util = est.setup.gpu_memory_utilization
    if util is not None:
        budget = int(capacity * util) - est.fixed_bytes
        tokens = budget / est.kv_bytes_per_token if budget > 0 and est.kv_bytes_per_token else 0
        out["vllm"] = {
            "gpu_memory_utilization": util,
            "kv_cache_bytes": max(0, budget),
            "kv_cache_tokens": int(tokens),
            "max_concurrency": round(tokens / est.setup.context, 2),
        }
    return out


def ways_to_serve(arch: Architecture, setup: ServeSetup, capacity: int) -> list[dict[str, Any]]:
    """When the setup does not fit: the changes that would, cheapest for the user first."""
    current = serve_estimate(arch, setup)
    usable = usable_bytes(capacity)
    if current.total_bytes <= usable:
        return []
    from dataclasses import replace

    ways: list[dict[str, Any]] = []

    def add(change: str, what: str, cost: str, candidate: ServeSetup) -> bool:
        try:
            est = serve_estimate(arch, candidate)
        except ArchitectureError:
            return False
        if est.total_bytes > usable:
            return False
        ways.append({"change": change, "what": what, "cost": cost,
                     "total_bytes": est.total_bytes, "fits": True})  # fmt: skip
        return True

    if setup.kv_dtype in ("bf16", "fp16", "fp32"):
        add("--kv-dtype fp8", "an fp8 KV cache", "an engine with fp8 KV (vLLM, TensorRT-LLM); "
            "a little accuracy", replace(setup, kv_dtype="fp8"))  # fmt: skip
    if quantized_bytes(setup.weights) is None:
        add("--quantize 4bit", "4-bit weights", "a quantized checkpoint; some accuracy",
            replace(setup, weights="4bit"))  # fmt: skip
    room = usable - current.fixed_bytes
    if room > 0 and setup.concurrency > 1:
        most = max_concurrency(current, room)
        if most >= 1:
            add(f"--concurrency {most}", f"{most} sequences at once", "less throughput",
                replace(setup, concurrency=most))  # fmt: skip
    if room > 0:
        longest = max_context(current, room)
        if 1 <= longest < setup.context:
            add(f"--context {longest}", f"contexts of {longest} tokens", "shorter prompts and "
                "answers", replace(setup, context=longest))  # fmt: skip
    for gpus in GPU_COUNTS:
        if gpus > setup.tp and add(
            f"--tp {gpus}", f"tensor parallel over {gpus} GPUs",
            f"{gpus} GPUs of this size, each holding 1/{gpus} of the weights and KV heads",
            replace(setup, tp=gpus),
        ):  # fmt: skip
            break
    # CPU offload of whole layers: the fewest that make it fit, and what each token then waits.
    for layers in range(1, arch.layers + 1):
        candidate = replace(setup, offload_layers=layers)
        est = serve_estimate(arch, candidate)
        if est.total_bytes <= usable:
            moved = est.details["offloaded_weights_bytes"]
            seconds = moved / PCIE_BYTES_PER_S
            ways.append({
                "change": f"--offload-layers {layers}",
                "what": f"{layers} of {arch.layers} layers' weights in CPU memory",
                "cost": f"each generated token streams {moved / 2**30:.1f} GiB over PCIe: about "
                        f"{seconds:.2f} s a token at 25 GB/s (accelerate's device_map / "
                        "llama.cpp's partial offload)",
                "total_bytes": est.total_bytes,
                "fits": True,
            })  # fmt: skip
            break
    return ways
