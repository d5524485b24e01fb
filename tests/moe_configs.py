"""Published Hugging Face `config.json` files of mixtures of experts, written here by hand (no
downloads), for tests/test_estimate.py: every key as the model's repository has it."""

from __future__ import annotations

from typing import Any

# mistralai/Mixtral-8x7B-v0.1/config.json.  Published: 46.7 B parameters, 12.9 B used per
# token (Mistral AI, "Mixtral of experts", 2023-12-11: "46.7B total parameters but only uses
# 12.9B parameters per token").
MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000,
}  # fmt: skip

# Qwen/Qwen1.5-MoE-A2.7B/config.json.  Published (its model card): "14.3B parameters in total
# and 2.7B activated parameters during runtime".
QWEN15_MOE_A27B: dict[str, Any] = {
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151643, "decoder_sparse_step": 1,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
    "model_type": "qwen2_moe", "moe_intermediate_size": 1408, "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 16, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 5632, "sliding_window": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}  # fmt: skip

# deepseek-ai/DeepSeek-V3/config.json.  Published (its README_WEIGHTS.md): the main model
# "Total parameters: 671B, Activation parameters: 36.6B (including 0.9B for the output
# Head)"; the MTP module "11.5B unique parameters (excluding the shared 0.9B Embedding and
# 0.9B output Head)"; 685 B on the hub with it.
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip

# openai/gpt-oss-120b/config.json.  Published (OpenAI's gpt-oss model card, table 1): total
# 116.83 B, active 5.13 B per token (attention 0.96 B, MLP 114.71 B, embed + unembed 1.16 B;
# the active count leaves out the input embedding); the checkpoint ~60.8 GiB (MXFP4 experts).
GPT_OSS_120B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "num_local_experts": 128, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
        "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False,
    },
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0",
    "use_cache": True, "vocab_size": 201088,
}  # fmt: skip

# deepseek-ai/DeepSeek-V2/config.json.  Published (DeepSeek-V2 paper, abstract): "236B total
# parameters, of which 21B are activated for each token".
DEEPSEEK_V2: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 100000,
    "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 12288,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1536, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 160,
    "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 128,
    "num_experts_per_tok": 6, "num_hidden_layers": 60, "num_key_value_heads": 128,
    "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
    "rope_theta": 10000, "routed_scaling_factor": 16.0, "scoring_func": "softmax",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 3,
    "topk_method": "group_limited_greedy", "torch_dtype": "bfloat16",
    "transformers_version": "4.39.3", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}  # fmt: skip

# Qwen/Qwen3-30B-A3B/config.json.  Published (its model card): "30.5B in total and 3.3B
# activated".
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip

# allenai/OLMoE-1B-7B-0924/config.json.  Published (the OLMoE paper, Muennighoff et al. 2024,
# table 1): 6.9 B total, 1.3 B active.
OLMOE_1B_7B: dict[str, Any] = {
    "architectures": ["OlmoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "clip_qkv": None, "eos_token_id": 50279, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 1024, "max_position_embeddings": 4096,
    "model_type": "olmoe", "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16,
    "num_key_value_heads": 16, "output_router_logits": False, "pad_token_id": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "router_aux_loss_coef": 0.01, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 50304,
}  # fmt: skip

PUBLISHED = {
    "mixtral-8x7b": MIXTRAL_8X7B,
    "qwen1.5-moe-a2.7b": QWEN15_MOE_A27B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "olmoe-1b-7b": OLMOE_1B_7B,
    "deepseek-v2": DEEPSEEK_V2,
    "deepseek-v3": DEEPSEEK_V3,
    "gpt-oss-120b": GPT_OSS_120B,
}
