"""A transformer's shape, and how many parameters each of its tensors holds.

Two families cover the decoder models people train: `llama` (rotary positions, RMSNorm, a gated
MLP of three matrices, no biases; Llama, Mistral, Qwen2, Gemma...) and `gpt` (learned positions,
LayerNorm, a 4h MLP of two matrices, biases; GPT-2, GPT-NeoX, OPT...).  The presets carry the
published architectures; a local Hugging Face `config.json` is read for its shape only; a bare
parameter count gets an assumed Llama-like shape (said so in the output).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from memtop.base import untrusted
from memtop.base.records import record
from memtop.estimate.config_keys import MOE_TYPES, checkpoint_weights, unread_size_keys

GPT, LLAMA = "gpt", "llama"

# The LoRA target names of each family, as PEFT and the HF module names spell them.
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT_LINEARS = ("c_attn", "attn.c_proj", "c_fc", "mlp.c_proj")
# PEFT's defaults for these families (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
DEFAULT_LORA_TARGETS = {LLAMA: ("q_proj", "v_proj"), GPT: ("c_attn",)}
ALL_LINEAR = "all-linear"
# A thousand times the largest model trained so far: a count above it is a typo (1e30 printed
# figures in the quintillions of TiB).
MAX_PARAMS = 1e15
# A Hugging Face config.json is a few KiB; one with a large label map (id2label) about 1 MiB.
MAX_CONFIG_BYTES = 16 << 20


class ArchitectureError(ValueError):
    """A model that cannot be described: the message is one line for the user."""


@record(frozen=True, slots=True)
class Architecture:
    name: str
    family: str  # GPT or LLAMA
    layers: int
    hidden: int
    heads: int
    vocab: int
    intermediate: int
    kv_heads: int
    positions: int = 0  # learned position embeddings (GPT family); 0 with rotary ones
    tied_embeddings: bool = False
    # A shape guessed from a parameter count: weights and states use `override_params`, the
    # per-tensor split (LoRA, QLoRA, Adafactor) and activations the guessed shape.
    assumed: bool = False
    override_params: int | None = None
    # -- read from configs beyond the dense decoder (all 0/False: the dense shapes above) ------
    head_dim: int = 0  # 0: hidden // heads (Mistral-Nemo, gpt-oss, Qwen3 set it apart)
    qkv_bias: bool = False  # biases on q, k, v (Qwen2; `attention_bias` in Llama, gpt-oss)
    o_bias: bool = False  # a bias on the output projection (`attention_bias` in Llama, gpt-oss)
    mlp_bias: bool = False  # biases on the MLP's matrices (Llama's `mlp_bias`)
    qk_norm_params: int = 0  # per layer: RMSNorms on q and k (OLMoE, Qwen3)
    attention_sinks: bool = False  # one learned logit per head (gpt-oss)
    # Mixture of experts: `experts` routed experts of `expert_intermediate` each in `moe_layers`
    # of the layers (the others dense, with `intermediate`); `experts_per_token` of them run
    # per token; the shared experts (all of them together: `shared_intermediate`) always run.
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    shared_expert_gate: bool = False  # Qwen2-MoE: a (hidden -> 1) gate on the shared expert
    expert_bias: bool = False  # gpt-oss: biases on the experts' matrices
    router_bias: bool = False  # gpt-oss: a bias on the router
    router_score_bias: bool = False  # DeepSeek-V3: e_score_correction_bias (one per expert)
    moe_layers: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank
    # projections; the KV cache holds the compressed latent and the rotary key only.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mtp_layers: int = 0  # DeepSeek-V3's multi-token-prediction modules (not in the count)
    # Layers whose attention sees only the last `sliding_window` tokens (their KV cache stops
    # growing there): Mistral's sliding window, gpt-oss's alternating layers.
    sliding_window: int = 0
    sliding_layers: int = 0
    # The checkpoint's stored weights when its config says they are quantized (`--quantize`'s
    # spelling: fp8, mxfp4, gptq-4bit-g128...): what serving loads unless told otherwise.
    checkpoint_weights: str | None = None

    # -- per layer ------------------------------------------------------------------------------

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def extended(self) -> bool:
        """Counted tensor by tensor (parameter_tensors) rather than by the dense formula."""
        return self.moe or self.mla

    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def attention_shapes(self) -> dict[str, tuple[int, int]]:
        """The attention's weight matrices of one llama-family block."""
        h, d = self.hidden, self.attention_head_dim()
        if self.mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            out: dict[str, tuple[int, int]] = {}
            if self.q_lora_rank:
                out["q_a_proj"] = (h, self.q_lora_rank)
                out["q_b_proj"] = (self.q_lora_rank, self.heads * qk)
            else:
                out["q_proj"] = (h, self.heads * qk)
            out["kv_a_proj_with_mqa"] = (h, self.kv_lora_rank + self.qk_rope_head_dim)
            out["kv_b_proj"] = (
                self.kv_lora_rank,
                self.heads * (self.qk_nope_head_dim + self.v_head_dim),
            )
            out["o_proj"] = (self.heads * self.v_head_dim, h)
            return out
        kv = self.kv_heads * d
        q = self.heads * d if self.head_dim else h  # without head_dim, as HF: q is h × h
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}

    @staticmethod
    def mlp_shapes(hidden: int, inter: int) -> dict[str, tuple[int, int]]:
        return {
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """The weight matrices of one block: name -> (in features, out features).  For a
        mixture of experts: the attention and one dense MLP (what LoRA's names refer to)."""
        h, i = self.hidden, self.intermediate
        if self.family == LLAMA:
            return {**self.attention_shapes(), **self.mlp_shapes(h, i)}
        return {
            "c_attn": (h, 3 * h),
            "attn.c_proj": (h, h),
            "c_fc": (h, i),
            "mlp.c_proj": (i, h),
        }

    def layer_vector_params(self) -> int:
        """Norm weights and biases of one block (kept in 16/32 bits even under QLoRA)."""
        h = self.hidden
        if self.family == LLAMA:
            shapes = self.attention_shapes()
            extra = self.qk_norm_params + (self.heads if self.attention_sinks else 0)
            if self.qkv_bias:
                extra += sum(shapes[n][1] for n in ("q_proj", "k_proj", "v_proj"))
            if self.o_bias:
                extra += h
            if self.mlp_bias:
                extra += 2 * self.intermediate + h
            return 2 * h + extra
        biases = sum(out for _, out in self.linear_shapes().values())
        return 4 * h + biases  # two LayerNorms (weight + bias)

    def layer_linear_params(self) -> int:
        return sum(a * b for a, b in self.linear_shapes().values())

    # -- whole model ----------------------------------------------------------------------------

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.positions * self.hidden

    def head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def final_norm_params(self) -> int:
        return self.hidden if self.family == LLAMA else 2 * self.hidden

    # -- tensor by tensor (mixtures of experts, latent attention) --------------------------------

    def expert_params(self) -> int:
        """One routed expert: a gated MLP of `expert_intermediate` (with gpt-oss's biases)."""
        h, i = self.hidden, self.expert_intermediate
        return 3 * h * i + (2 * i + h if self.expert_bias else 0)

    def block_tensors(self) -> list[tuple[tuple[int, ...], int, str]]:
        """(shape as torch holds it, how many, what) of every tensor in the blocks of an
        extended architecture; `what` is attention, mlp (dense layers), expert, shared, router
        or norm."""
        h, L = self.hidden, self.layers
        dense = L - self.moe_layers
        out: list[tuple[tuple[int, ...], int, str]] = []
        for a, b in self.attention_shapes().values():
            out.append(((b, a), L, "attention"))
        if self.qkv_bias:
            for name in ("q_proj", "k_proj", "v_proj"):
                out.append(((self.attention_shapes()[name][1],), L, "attention"))
        if self.o_bias:
            out.append(((h,), L, "attention"))
        if self.q_lora_rank:
            out.append(((self.q_lora_rank,), L, "norm"))  # q_a_layernorm
        if self.mla:
            out.append(((self.kv_lora_rank,), L, "norm"))  # kv_a_layernorm
        if self.qk_norm_params:
            out.append(((self.qk_norm_params,), L, "norm"))
        if self.attention_sinks:
            out.append(((self.heads,), L, "attention"))
        out.append(((h,), 2 * L, "norm"))  # the two RMSNorms of each block
        if dense:
            for a, b in self.mlp_shapes(h, self.intermediate).values():
                out.append(((b, a), dense, "mlp"))
            if self.mlp_bias:
                out.append(((self.intermediate,), 2 * dense, "mlp"))
                out.append(((h,), dense, "mlp"))
        if self.moe_layers:
            n = self.moe_layers
            for a, b in self.mlp_shapes(h, self.expert_intermediate).values():
                out.append(((b, a), n * self.experts, "expert"))
            if self.expert_bias:
                out.append(((self.expert_intermediate,), 2 * n * self.experts, "expert"))
                out.append(((h,), n * self.experts, "expert"))
            if self.shared_intermediate:
                for a, b in self.mlp_shapes(h, self.shared_intermediate).values():
                    out.append(((b, a), n, "shared"))
            if self.shared_expert_gate:
                out.append(((1, h), n, "shared"))
            out.append(((self.experts, h), n, "router"))
            if self.router_bias or self.router_score_bias:
                out.append(((self.experts,), n, "router"))
        return out

    def active_parameter_count(self) -> int:
        """What one token runs through: all but the routed experts it is not sent to (the
        embedding table counted whole, as Mixtral's 12.9 B and Qwen1.5-MoE's 2.7 B count)."""
        idle = self.moe_layers * (self.experts - self.experts_per_token) * self.expert_params()
        return self.parameter_count() - round(idle * self.scale())

    def mtp_parameter_count(self) -> int:
        """DeepSeek-V3's multi-token-prediction modules: one more MoE block each, two RMSNorms
        and a (2h -> h) projection (their embedding and head are the main model's): not loaded
        by transformers, so not in parameters_count; said apart."""
        if not self.mtp_layers:
            return 0
        h = self.hidden  # enorm, hnorm, shared_head.norm; eh_proj
        return self.mtp_layers * (self._moe_block_params() + 3 * h + 2 * h * h)

    def _moe_block_params(self) -> int:
        """One MoE block's parameters (attention, experts, router, norms)."""
        moe_only = replace(self, layers=1, moe_layers=1, mtp_layers=0)
        return sum(math.prod(shape) * n for shape, n, _ in moe_only.block_tensors())

    def counted_params(self) -> int:
        """Parameters from the shape alone."""
        if self.extended:
            return sum(math.prod(shape) * n for shape, n in self.parameter_tensors())
        per_layer = self.layer_linear_params() + self.layer_vector_params()
        return (
            self.layers * per_layer
            + self.embedding_params()
            + self.head_params()
            + self.final_norm_params()
        )

    def parameter_count(self) -> int:
        return self.override_params if self.override_params is not None else self.counted_params()

    def scale(self) -> float:
        """How much the real count exceeds the assumed shape's (1 unless --params is given)."""
        return self.parameter_count() / max(1, self.counted_params())

    def block_linear_params(self) -> int:
        """Parameters in the blocks' weight matrices: what QLoRA quantizes."""
        if self.extended:
            return round(
                sum(math.prod(s) * n for s, n, _ in self.block_tensors() if len(s) == 2)
                * self.scale()
            )
        return round(self.layers * self.layer_linear_params() * self.scale())

    def matrices(self) -> list[tuple[int, int, int]]:
        """(rows, cols, how many) of every weight matrix, for factored optimizer states."""
        if self.extended:
            out = [(s[1], s[0], n) for s, n, _ in self.block_tensors() if len(s) == 2]
        else:
            out = [(a, b, self.layers) for a, b in self.linear_shapes().values()]
        out.append((self.vocab, self.hidden, 1))
        if self.positions:
            out.append((self.positions, self.hidden, 1))
        if not self.tied_embeddings:
            out.append((self.vocab, self.hidden, 1))
        return out

    def parameter_tensors(self) -> list[tuple[tuple[int, ...], int]]:
        """(shape, how many) of every parameter tensor, as torch holds them (a Linear's weight
        is (out, in)): what per-tensor optimizer states (Adafactor's factored moments,
        bitsandbytes' blocks and its 32-bit small tensors) are sized by."""
        h = self.hidden
        if self.extended:
            tensors = [(shape, n) for shape, n, _ in self.block_tensors()]
            tensors.append(((h,), 1))  # the final norm
            tensors.append(((self.vocab, h), 1))
            if not self.tied_embeddings:
                tensors.append(((self.vocab, h), 1))
            return tensors
        out: list[tuple[tuple[int, ...], int]] = [
            ((b, a), self.layers) for a, b in self.linear_shapes().values()
        ]
        if self.family == LLAMA:
            out.append(((h,), 2 * self.layers))  # two RMSNorms per block
            out.append(((h,), 1))  # the final norm
        else:
            out += [((b,), self.layers) for _, b in self.linear_shapes().values()]  # biases
            out.append(((h,), 4 * self.layers + 2))  # LayerNorms' weights and biases
        out.append(((self.vocab, h), 1))
        if self.positions:
            out.append(((self.positions, h), 1))
        if not self.tied_embeddings:
            out.append(((self.vocab, h), 1))
        return out

    def vector_params(self) -> int:
        if self.extended:
            return sum(math.prod(s) * n for s, n in self.parameter_tensors() if len(s) == 1)
        return self.layers * self.layer_vector_params() + self.final_norm_params()

    def largest_layer_params(self) -> int:
        """The largest single module (DeepSpeed's `largest_layer_params`: an embedding or one
        linear), gathered whole under ZeRO-3."""
        biggest = max(a * b for a, b in self.linear_shapes().values())
        if self.extended:
            biggest = max(math.prod(s) for s, _, _ in self.block_tensors())
        return round(max(biggest, self.vocab * self.hidden) * self.scale())

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Adapter parameters: rank × (in + out) per targeted matrix per layer."""
        shapes = self.linear_shapes()
        return sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets) * self.layers

    def resolve_targets(self, targets: tuple[str, ...] | None) -> tuple[str, ...]:
        """LoRA target names for this family; a one-line error names the valid ones."""
        known = tuple(self.linear_shapes())
        if self.moe:
            # Adapters on the attention only: per-expert adapters (and PEFT's names for them,
            # which differ by family) are not counted, so they are refused, not guessed.
            known = tuple(self.attention_shapes())
        if not targets:
            default = DEFAULT_LORA_TARGETS[self.family]
            if all(t in known for t in default):
                return default
            raise ArchitectureError(
                f"name the LoRA targets (--lora-targets) of this model: {', '.join(known)}"
            )
        if ALL_LINEAR in targets:
            if self.moe:
                raise ArchitectureError(
                    "LoRA on the experts' matrices is not estimated: name attention targets "
                    f"({', '.join(known)})"
                )
            return known
        aliases = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
        resolved = []
        for name in targets:
            name = aliases.get(name, name) if self.family == LLAMA else name
            if name not in known:
                raise ArchitectureError(
                    f"LoRA target {name!r} is not a matrix of a {self.family} block; "
                    f"choose from {', '.join(known)} or {ALL_LINEAR}"
                )
            resolved.append(name)
        return tuple(dict.fromkeys(resolved))

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "layers": self.layers,
            "hidden": self.hidden,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "intermediate": self.intermediate,
            "vocab": self.vocab,
            "positions": self.positions,
            "tied_embeddings": self.tied_embeddings,
            "assumed_shape": self.assumed,
        }


def _llama(name: str, layers: int, hidden: int, heads: int, inter: int, kv: int) -> Architecture:
    return Architecture(name, LLAMA, layers, hidden, heads, 32000, inter, kv)


# Published shapes (the models' config.json on the Hugging Face hub).
PRESETS: dict[str, Architecture] = {
    "llama-7b": _llama("llama-7b", 32, 4096, 32, 11008, 32),
    "llama-13b": _llama("llama-13b", 40, 5120, 40, 13824, 40),
    "llama-65b": _llama("llama-65b", 80, 8192, 64, 22016, 64),
    "llama-70b": _llama("llama-70b", 80, 8192, 64, 28672, 8),
    "llama3-8b": replace(_llama("llama3-8b", 32, 4096, 32, 14336, 8), vocab=128256),
    "mistral-7b": _llama("mistral-7b", 32, 4096, 32, 14336, 8),
    "gpt2": Architecture("gpt2", GPT, 12, 768, 12, 50257, 3072, 12, 1024, True),
    "gpt2-xl": Architecture("gpt2-xl", GPT, 48, 1600, 25, 50257, 6400, 25, 1024, True),
    # The trainer of shared/traces/cuda-h100 (shared/gpu/train_gpt.py): a 12-layer GPT, d=768,
    # vocab 32000, no position table, an untied head: 134 M parameters.
    "memtop-gpt-134m": Architecture("memtop-gpt-134m", GPT, 12, 768, 12, 32000, 3072, 12),
}

GATED_ACTIVATIONS = ("silu", "swiglu", "swish", "gelu_pytorch_tanh_gated", "geglu")
GPT_TYPES = ("gpt2", "gpt_neo", "gpt_neox", "gptj", "opt", "bloom", "gpt_bigcode", "falcon")


def _first(config: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        value = config.get(key)
        if value is not None:
            return value
    return None


class UnreadConfigKey(ArchitectureError):
    """A config key that changes the model's size and that the estimate does not read: the
    estimate refuses rather than count the model wrong (DESIGN §13, exit 2)."""


def _count(config: dict[str, Any], key: str, default: int = 0) -> int:
    """A non-negative integer setting, or a one-line error naming it."""
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ArchitectureError(f"{key} must be a non-negative integer, not {value!r}")
    return value


def _moe_layer_count(config: dict[str, Any], model_type: str, layers: int) -> int:
    """How many of the layers hold experts, by each family's rule (its modeling code)."""
    if model_type in ("deepseek_v2", "deepseek_v3"):
        # DeepseekV3DecoderLayer: experts where idx >= first_k_dense_replace and
        # idx % moe_layer_freq == 0.
        first = _count(config, "first_k_dense_replace")
        freq = max(1, _count(config, "moe_layer_freq", 1))
        return sum(1 for i in range(layers) if i >= first and i % freq == 0)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        # Qwen2MoeDecoderLayer: experts where idx is not in mlp_only_layers and
        # (idx + 1) % decoder_sparse_step == 0.
        step = max(1, _count(config, "decoder_sparse_step", 1))
        only = config.get("mlp_only_layers") or []
        if not isinstance(only, list):
            raise ArchitectureError(f"mlp_only_layers must be a list, not {only!r}")
        return sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)
    return layers  # Mixtral, OLMoE, gpt-oss: every layer


def _moe_fields(config: dict[str, Any], model_type: str, layers: int) -> dict[str, Any]:
    experts = _count(config, "num_local_experts") or _count(config, "num_experts")
    experts = experts or _count(config, "n_routed_experts")
    if not experts:
        return {}
    if model_type not in MOE_TYPES:
        raise UnreadConfigKey(
            f"model_type {model_type or '(none)'!r} is a mixture of experts memtop has not "
            f"checked against a published count (it reads {', '.join(sorted(MOE_TYPES))})"
        )
    top_k = _count(config, "num_experts_per_tok") or _count(config, "experts_per_token")
    if not 0 < top_k <= experts:
        raise ArchitectureError(
            f"num_experts_per_tok must be between 1 and the {experts} experts, not {top_k}"
        )
    hidden_inter = _count(config, "intermediate_size")
    expert_inter = _count(config, "moe_intermediate_size") or hidden_inter
    fields: dict[str, Any] = {
        "experts": experts,
        "experts_per_token": top_k,
        "expert_intermediate": expert_inter,
        "moe_layers": _moe_layer_count(config, model_type, layers),
    }
    if model_type == "qwen2_moe":
        fields["shared_intermediate"] = _count(config, "shared_expert_intermediate_size")
        fields["shared_expert_gate"] = bool(fields["shared_intermediate"])
    elif model_type in ("deepseek_v2", "deepseek_v3"):
        fields["shared_intermediate"] = _count(config, "n_shared_experts") * expert_inter
        # DeepseekV3TopkRouter keeps e_score_correction_bias (V2's "greedy" router does not).
        fields["router_score_bias"] = model_type == "deepseek_v3" or (
            config.get("topk_method") == "noaux_tc"
        )
    elif model_type == "gpt_oss":
        fields["expert_bias"] = fields["router_bias"] = True
    return fields


def from_hf_config(config: dict[str, Any], name: str = "config.json") -> Architecture:
    """The shape out of a Hugging Face config dict (a composite one's `text_config`).  A key
    that changes the size and that this does not read is refused by name (UnreadConfigKey)."""
    unread = unread_size_keys(config)
    if isinstance(config.get("text_config"), dict):
        inner = config["text_config"]
        unread += unread_size_keys(inner)
        config = {
            **inner,
            "model_type": inner.get("model_type") or config.get("model_type"),
            "quantization_config": config.get("quantization_config")
            or inner.get("quantization_config"),
        }
    if unread:
        raise UnreadConfigKey(
            f"{name}: {', '.join(repr(k) for k in unread)} would change the model's size and "
            "memtop's estimate does not read "
            + ("it" if len(unread) == 1 else "them")
            + ": refusing rather than counting the model wrong"
        )
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(config, "num_attention_heads", "n_head")
    vocab = _first(config, "vocab_size")
    missing = [
        key
        for key, value in (
            ("hidden_size", hidden),
            ("num_hidden_layers", layers),
            ("num_attention_heads", heads),
            ("vocab_size", vocab),
        )
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0
    ]
    if missing:
        raise ArchitectureError(f"{name}: no positive integer {', '.join(missing)}")
    assert isinstance(hidden, int) and isinstance(layers, int)
    assert isinstance(heads, int) and isinstance(vocab, int)
    model_type = str(config.get("model_type") or "")
    act = str(_first(config, "hidden_act", "activation_function") or "")
    family = GPT if model_type in GPT_TYPES or (not act and "n_embd" in config) else LLAMA
    if model_type not in GPT_TYPES and act and act not in GATED_ACTIVATIONS:
        family = GPT
    moe = _moe_fields(config, model_type, layers)
    inter = _first(config, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    kv = _first(config, "num_key_value_heads", "multi_query_group_num") or heads
    positions = 0
    if family == GPT and model_type != "gpt_neox":  # NeoX uses rotary positions
        positions = int(_first(config, "n_positions", "max_position_embeddings") or 0)
    tied = config.get("tie_word_embeddings")
    if tied is None:
        tied = family == GPT  # HF's defaults: GPT-2 ties, Llama does not
    extra: dict[str, Any] = dict(moe)
    if config.get("head_dim") is not None and family == LLAMA:
        extra["head_dim"] = _count(config, "head_dim")
    if model_type in ("qwen2", "qwen2_moe"):
        extra["qkv_bias"] = True  # Qwen2Attention: q, k, v with biases, o without
    if config.get("attention_bias") and family == LLAMA:
        extra["qkv_bias"] = extra["o_bias"] = True
    if config.get("mlp_bias") and family == LLAMA:
        if moe:
            raise UnreadConfigKey(f"{name}: 'mlp_bias' on a mixture of experts is not read")
        extra["mlp_bias"] = True
    head_dim = _count(config, "head_dim") or hidden // heads
    if model_type == "olmoe":
        extra["qk_norm_params"] = hidden + int(kv) * head_dim  # q_norm(h), k_norm(kv·d)
    elif model_type in ("qwen3", "qwen3_moe"):
        extra["qk_norm_params"] = 2 * head_dim  # q_norm and k_norm over one head
    if model_type == "gpt_oss":
        extra["attention_sinks"] = True
    if config.get("kv_lora_rank"):
        if model_type not in ("deepseek_v2", "deepseek_v3"):
            raise UnreadConfigKey(f"{name}: 'kv_lora_rank' outside DeepSeek-V2/V3 is not read")
        extra.update(
            q_lora_rank=_count(config, "q_lora_rank"),
            kv_lora_rank=_count(config, "kv_lora_rank"),
            qk_nope_head_dim=_count(config, "qk_nope_head_dim"),
            qk_rope_head_dim=_count(config, "qk_rope_head_dim"),
            v_head_dim=_count(config, "v_head_dim"),
            mtp_layers=_count(config, "num_nextn_predict_layers"),
        )
    try:
        stored = checkpoint_weights(config.get("quantization_config"))
    except ValueError as exc:
        raise UnreadConfigKey(f"{name}: {exc}") from None
    if stored:
        extra["checkpoint_weights"] = stored
    window = config.get("sliding_window")
    if isinstance(window, int) and not isinstance(window, bool) and window > 0:
        types = config.get("layer_types")
        if isinstance(types, list):
            sliding = sum(1 for t in types if t == "sliding_attention")
        elif config.get("use_sliding_window") is False:
            sliding = 0  # Qwen2: the window is off
        elif config.get("use_sliding_window") and config.get("max_window_layers") is not None:
            sliding = max(0, layers - _count(config, "max_window_layers"))
        else:
            sliding = layers  # Mistral 7B v0.1: every layer
        if sliding:
            extra.update(sliding_window=window, sliding_layers=min(sliding, layers))
    return Architecture(
        name=str(config.get("_name_or_path") or model_type or name),
        family=family,
        layers=layers,
        hidden=hidden,
        heads=heads,
        vocab=vocab,
        intermediate=int(inter),
        kv_heads=int(kv),
        positions=positions,
        tied_embeddings=bool(tied),
        **extra,
    )


def load_hf_config(path: str | Path) -> Architecture:
    """Read a local `config.json` (or a directory holding one); never downloads anything."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    # A config someone hands you (a download, a shared directory), read as memtop reads every
    # file it did not write: a FIFO hung here, and `[` nested 100 000 deep was a traceback.
    try:
        config = untrusted.load_json_file(path, MAX_CONFIG_BYTES)
    except OSError as exc:
        raise ArchitectureError(f"cannot read {path}: {exc.strerror or exc}") from None
    except untrusted.UntrustedInput as exc:  # "is not JSON", "nests deeper than 64 levels"
        raise ArchitectureError(f"{path} {exc}") from None
    if not isinstance(config, dict):
        raise ArchitectureError(f"{path} does not hold a JSON object")
    return from_hf_config(config, name=path.name)


def assumed_shape(params: int) -> Architecture:
    """A Llama-like shape for a bare parameter count: hidden = 128 × layers (Llama 7B/13B's
    ratio), so params ≈ 12·L·h² gives L = (params / 196608)^(1/3); heads of 128."""
    if params <= 0:
        raise ArchitectureError("--params must be a positive count")
    layers = max(1, round((params / 196_608) ** (1 / 3)))
    hidden = max(128, 128 * layers)
    inter = max(256, math.ceil(hidden * 8 / 3 / 256) * 256)
    heads = hidden // 128
    return Architecture(
        name=f"--params {params / 1e9:.4g}B",
        family=LLAMA,
        layers=layers,
        hidden=hidden,
        heads=heads,
        vocab=32000,
        intermediate=inter,
        kv_heads=heads,
        assumed=True,
        override_params=params,
    )


def parse_count(text: str) -> int:
    """7e9, 7B, 134M, 6738415616 -> an integer count."""
    original = text.strip()
    text = original.replace("_", "").replace(",", "")
    scale = 1
    suffixes = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    if text and text[-1].lower() in suffixes:
        scale, text = suffixes[text[-1].lower()], text[:-1]  # type: ignore[assignment]
    try:
        value = float(text) * scale
    except ValueError:
        raise ArchitectureError(
            f"--params {original}: not a parameter count (e.g. 7e9, 7B, 134M)"
        ) from None
    if not math.isfinite(value) or value < 1:
        raise ArchitectureError(f"--params {original}: a parameter count must be at least 1")
    if value > MAX_PARAMS:
        raise ArchitectureError(
            f"--params {original}: more than any model (at most 1e15 parameters)"
        )
    return int(value)
