"""Which keys of a Hugging Face `config.json` the estimate reads, which it knows change nothing
it counts, and which look like they change the model's size.

A key the estimate does not read but that changes the size (a new kind of expert, a vision
tower, a second MLP) would make its count silently wrong, so such a key is refused by name
(DESIGN §13: one line, exit 2).  What "looks like it changes the size" is a pattern over the
key's name, so a new family's keys are refused until someone reads them; the keys known to
change nothing (token ids, dropout, rope settings, router loss weights) are listed apart.
"""

from __future__ import annotations

import re
from typing import Any

# Read by memtop.estimate.architecture.from_hf_config.
READ = frozenset(
    {
        "_name_or_path", "model_type", "text_config",
        "hidden_size", "n_embd", "d_model",
        "num_hidden_layers", "n_layer", "num_layers",
        "num_attention_heads", "n_head",
        "num_key_value_heads", "multi_query_group_num", "head_dim",
        "vocab_size", "hidden_act", "activation_function",
        "intermediate_size", "n_inner", "ffn_dim",
        "n_positions", "max_position_embeddings", "n_ctx", "tie_word_embeddings",
        "attention_bias", "mlp_bias",
        # mixtures of experts
        "num_local_experts", "num_experts", "n_routed_experts",
        "num_experts_per_tok", "experts_per_token",
        "moe_intermediate_size", "shared_expert_intermediate_size", "n_shared_experts",
        "first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step", "mlp_only_layers",
        "topk_method",
        # latent attention (DeepSeek-V2/V3) and its multi-token prediction
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "num_nextn_predict_layers",
        # attention windows (the KV cache when serving)
        "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
        # a checkpoint stored quantized (its weights' bytes when serving)
        "quantization_config", "torch_dtype", "dtype",
    }
)  # fmt: skip

# Known to change nothing the estimate counts.
HARMLESS = frozenset(
    {
        "architectures", "auto_map", "transformers_version", "use_cache",
        "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
        "initializer_range", "initializer_factor", "rms_norm_eps", "layer_norm_eps",
        "layer_norm_epsilon", "norm_epsilon",
        "rope_theta", "rope_scaling", "rope_parameters", "rope_interleave", "partial_rotary_factor",
        "rotary_pct", "rotary_emb_base", "rope_ntk_alpha", "rope_ntk_beta",
        "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
        "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
        "summary_first_dropout", "task_specific_params", "id2label", "label2id",
        "scale_attn_weights", "reorder_and_upcast_attn", "scale_attn_by_inverse_layer_idx",
        "pretraining_tp", "output_router_logits", "router_aux_loss_coef", "router_z_loss_coef",
        "router_jitter_noise", "norm_topk_prob", "routed_scaling_factor", "n_group",
        "topk_group", "scoring_func", "aux_loss_alpha", "seq_aux", "ep_size", "clip_qkv",
        "swiglu_limit", "initial_context_length", "use_bfloat16", "bias",
    }
)  # fmt: skip

# The mixtures of experts whose layout memtop counts, each checked against its published
# counts in tests/test_estimate.py.  Granite MoE and Llama 4 share the fields but are not
# checked (Llama 4's published totals include its vision tower): refused until they are.
MOE_TYPES = frozenset(
    {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe", "gpt_oss"}
)

# A name that says it sizes something: a count, a dimension, a rank, an extra sub-model.
SIZE_LIKE = re.compile(
    r"expert|moe|lora|rank|layer|head|dim|size|vocab|hidden|intermediate|ffn|inner|embed|"
    r"nextn|mtp|shared|window|vision|audio|encoder|decoder|adapter|proj|^num_|^n_|_config$"
)
# Sub-objects that hold settings, not another model's weights.
SETTINGS_OBJECTS = frozenset(
    {"rope_scaling", "rope_parameters", "quantization_config", "auto_map", "id2label",
     "label2id", "task_specific_params", "text_config"}
)  # fmt: skip


def unread_size_keys(config: dict[str, Any]) -> list[str]:
    """The keys of `config` that look like they change the model's size and that the estimate
    does not read, in the file's order."""
    out = []
    for key, value in config.items():
        if key in READ or key in HARMLESS:
            continue
        if isinstance(value, dict) and key not in SETTINGS_OBJECTS:
            out.append(key)  # a sub-model (vision tower, audio encoder...) counted nowhere
        elif SIZE_LIKE.search(key) and value not in (None, False, 0, [], ""):
            out.append(key)
    return out


def checkpoint_weights(quantization: Any) -> str | None:
    """The stored weights' format a config's `quantization_config` says (a `--quantize` value),
    or None if it says none; ValueError for a method memtop does not size (its bytes would be a
    guess)."""
    if not quantization:
        return None
    if not isinstance(quantization, dict):
        raise ValueError("quantization_config is not an object")
    method = str(quantization.get("quant_method") or "")
    if method in ("gptq", "awq"):
        bits, group = quantization.get("bits", 4), quantization.get("group_size", 128)
        if not isinstance(bits, int) or not isinstance(group, int) or group < 1:
            raise ValueError(f"quantization_config ({method}): bits or group_size unreadable")
        return f"{method}-{bits}bit-g{group}"
    if method in ("fp8", "mxfp4"):
        return method
    if method == "bitsandbytes":
        if quantization.get("load_in_4bit"):
            return "4bit"
        if quantization.get("load_in_8bit"):
            return "8bit"
    raise ValueError(
        f"quantization_config: quant_method {method or '(none)'!r} is not one memtop sizes "
        "(gptq, awq, fp8, mxfp4, bitsandbytes)"
    )
