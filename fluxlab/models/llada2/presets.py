"""config.json contents for the published LLaDA2 shapes and the tiny test model.

Field names are the real ones; values as published (DESIGN §4). vocab_size of `tiny` is set by
its trained tokenizer when the checkpoint is written (see fluxlab/checkpoint.py).
"""
import copy

_AUTO_MAP = {
    "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
    "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
    "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
}

_COMMON = {
    "architectures": ["LLaDA2MoeModelLM"],
    "attention_dropout": 0.0,
    "auto_map": _AUTO_MAP,
    "embedding_dropout": 0.0,
    "first_k_dense_replace": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 32768,
    "model_type": "llada2_moe",
    "moe_router_enable_expert_bias": True,
    "n_group": 8,
    "norm_head": False,
    "norm_softmax": False,
    "norm_topk_prob": True,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "num_key_value_heads": 4,
    "num_shared_experts": 1,
    "output_dropout": 0.0,
    "output_router_logits": False,
    "pad_token_id": 156892,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-06,
    "rope_theta": 600000,
    "rotary_dim": 64,
    "routed_scaling_factor": 2.5,
    "router_dtype": "fp32",
    "score_function": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "torch_dtype": "bfloat16",
    "use_bias": False,
    "use_cache": False,
    "use_qkv_bias": False,
    "use_rmsnorm": True,
    "vocab_size": 157184,
}

_MINI = {"hidden_size": 2048, "intermediate_size": 5120, "moe_intermediate_size": 512,
         "num_hidden_layers": 20, "num_attention_heads": 16, "max_window_layers": 20}
_FLASH = {"hidden_size": 4096, "intermediate_size": 9216, "moe_intermediate_size": 1024,
          "num_hidden_layers": 32, "num_attention_heads": 32, "max_window_layers": 32}

# Tiny: same architecture at toy size. Layer 0 dense, layers 1-2 MoE; 16 experts in 4 groups.
_TINY = {
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rotary_dim": 8, "num_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
    "max_position_embeddings": 4096, "max_window_layers": 3, "rope_theta": 10000,
    "torch_dtype": "float32", "vocab_size": None, "pad_token_id": None,
}

# GPU tests: the real head geometry (head_dim 128, GQA 16/4, 256 experts, vocab) at 2 layers.
_SMALL = {"hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 16, "max_window_layers": 2}

# LLaDA2.2 (DESIGN §4b): the LLaDA2.0 shapes plus block routing (expert_capacity experts per routing
# block of block_size tokens) and the DELETE/SPLIT edit-token ids. Its stop ids live in
# generation_config.json (see GENERATION_CONFIGS).
_LLADA22 = {"expert_capacity": 48, "block_size": 32, "delete_token_id": 156930, "split_token_id": 156931}
# Tiny twin: 6 of 16 experts per routing block of 8 tokens, so the pool really restricts the top-4
# choices (8 tokens x 4 choices rarely fit in 6 experts). Edit ids are set from its tokenizer.
_TINY_LLADA22 = {"expert_capacity": 6, "block_size": 8, "delete_token_id": None, "split_token_id": None}

PRESETS = {
    "tiny": {**_COMMON, **_TINY},
    "small": {**_COMMON, **_SMALL},
    "llada2_mini": {**_COMMON, **_MINI},
    "llada2_flash": {**_COMMON, **_FLASH},
    "llada21_mini": {**_COMMON, **_MINI},
    "llada21_flash": {**_COMMON, **_FLASH},
    "llada22_mini": {**_COMMON, **_MINI, **_LLADA22},
    "llada22_flash": {**_COMMON, **_FLASH, **_LLADA22},
    "tiny_llada22": {**_COMMON, **_TINY, **_TINY_LLADA22},
}

# Presets whose checkpoint is written by fluxlab itself with a trained tiny tokenizer.
TINY_PRESETS = ("tiny", "tiny_llada22")

# The released checkpoints' tokenizer ids (not in config.json).
MASK_TOKEN_ID = 156895
EOS_TOKEN_ID = 156892
# LLaDA2.2's generation_config.json: a request stops on either id.
LLADA22_STOP_TOKEN_IDS = (156892, 156900)
GENERATION_CONFIGS = {
    "llada22_mini": {"eos_token_id": list(LLADA22_STOP_TOKEN_IDS), "pad_token_id": EOS_TOKEN_ID},
    "llada22_flash": {"eos_token_id": list(LLADA22_STOP_TOKEN_IDS), "pad_token_id": EOS_TOKEN_ID},
}


def preset_config(name: str) -> dict:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def preset_generation_config(name: str) -> dict | None:
    """generation_config.json of a published preset when it differs from {eos, pad} (LLaDA2.2:
    two stop ids); None for presets whose ids come from the tokenizer alone."""
    preset_config(name)  # unknown names are an error
    return copy.deepcopy(GENERATION_CONFIGS.get(name))
