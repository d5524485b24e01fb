"""A transformer's shape, and how many parameters each of its tensors holds.

Two families cover the decoder models people train: `llama` (rotary positions, RMSNorm, a gated
MLP of three matrices, no biases; Llama, Mistral, Qwen2, Gemma...) and `gpt` (learned positions,
LayerNorm, a 4h MLP of two matrices, biases; GPT-2, GPT-NeoX, OPT...).  The presets carry the
published architectures; a local Hugging Face `config.json` is read for its shape only; a bare
parameter count gets an assumed Llama-like shape (said so in the output).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from memtop import untrusted

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


@dataclass(frozen=True, slots=True)
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

    # -- per layer ------------------------------------------------------------------------------

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """The weight matrices of one block: name -> (in features, out features)."""
        h, i = self.hidden, self.intermediate
        if self.family == LLAMA:
            kv = self.kv_heads * (h // self.heads)
            return {
                "q_proj": (h, h),
                "k_proj": (h, kv),
                "v_proj": (h, kv),
                "o_proj": (h, h),
                "gate_proj": (h, i),
                "up_proj": (h, i),
                "down_proj": (i, h),
            }
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
            return 2 * h
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

    def counted_params(self) -> int:
        """Parameters from the shape alone."""
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
        return round(self.layers * self.layer_linear_params() * self.scale())

    def matrices(self) -> list[tuple[int, int, int]]:
        """(rows, cols, how many) of every weight matrix, for factored optimizer states."""
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
        return self.layers * self.layer_vector_params() + self.final_norm_params()

    def largest_layer_params(self) -> int:
        """The largest single module (DeepSpeed's `largest_layer_params`: an embedding or one
        linear), gathered whole under ZeRO-3."""
        biggest = max(a * b for a, b in self.linear_shapes().values())
        return round(max(biggest, self.vocab * self.hidden) * self.scale())

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Adapter parameters: rank × (in + out) per targeted matrix per layer."""
        shapes = self.linear_shapes()
        return sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets) * self.layers

    def resolve_targets(self, targets: tuple[str, ...] | None) -> tuple[str, ...]:
        """LoRA target names for this family; a one-line error names the valid ones."""
        known = tuple(self.linear_shapes())
        if not targets:
            return DEFAULT_LORA_TARGETS[self.family]
        if ALL_LINEAR in targets:
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


def from_hf_config(config: dict[str, Any], name: str = "config.json") -> Architecture:
    """The shape out of a Hugging Face config dict (a composite one's `text_config`)."""
    if isinstance(config.get("text_config"), dict):
        config = {**config["text_config"], "model_type": config.get("model_type")}
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
    inter = _first(config, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    kv = _first(config, "num_key_value_heads", "multi_query_group_num") or heads
    positions = 0
    if family == GPT and model_type != "gpt_neox":  # NeoX uses rotary positions
        positions = int(_first(config, "n_positions", "max_position_embeddings") or 0)
    tied = config.get("tie_word_embeddings")
    if tied is None:
        tied = family == GPT  # HF's defaults: GPT-2 ties, Llama does not
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
