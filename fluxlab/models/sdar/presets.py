"""config.json contents of the published SDAR shapes and the tiny test twins.

Sources (each number): SDAR-8B-Chat's config.json as OpenMOSS/DiRL ships it (models/sdar/config.json @ ec4bfb3:
hidden 4096, 36 layers, 32 heads, 8 KV heads, head_dim 128, intermediate 12288, rope_theta 1e6, rms 1e-6, vocab
151936, untied, bos/eos 151643, mask_token_id 151669, block_size 4). SDAR-30B-A3B is Qwen3-30B-A3B continued
(JetAstra/SDAR README, "Applying SDAR to Qwen3-30B-MoE"); the Qwen3-30B-A3B shapes are those of
zyzshishui/slime scripts/models/qwen3-30B-A3B.sh (48 layers, hidden 2048, 32 heads, 4 query groups, kv-channels
128, moe-ffn-hidden 768, 128 experts, top-8, softmax router, untied, vocab 151936, rotary base 1e6), and the MoE
rules (norm_topk_prob, decoder_sparse_step, mlp_only_layers) are read as in OpenMOSS/DiRL
lmdeploy/pytorch/models/sdar_moe.py. The mask token <|MASK|> = 151669: JetAstra/SDAR README (JetEngine example,
mask_token_id=151669) and the DiRL config above.
"""
import copy

MASK_TOKEN_ID = 151669  # <|MASK|>
EOS_TOKEN_ID = 151643  # <|endoftext|> (config.json eos_token_id of SDAR-8B as DiRL ships it)

_AUTO_MAP = {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
             "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"}

_COMMON = {
    "architectures": ["SDARForCausalLM"], "auto_map": _AUTO_MAP, "model_type": "sdar",
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": EOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": None, "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": False, "vocab_size": 151936, "fuse_cross_entropy": False,
}

_SDAR_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "max_window_layers": 36}
_SDAR_30B_A3B = {"model_type": "sdar_moe", "architectures": ["SDARMoeForCausalLM"],
                 "auto_map": {"AutoConfig": "configuration_sdar_moe.SDARMoeConfig",
                              "AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM"},
                 "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "moe_intermediate_size": 768, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "max_window_layers": 48}

# Tiny twins for parity tests: the real layer types at toy size, fp32; vocab and special ids come from fluxlab's
# tiny trained tokenizer when the checkpoint is written. tiny_sdar ties its embeddings (as the small Qwen3-based
# SDARs are expected to) and tiny_sdar_moe does not, so both head layouts are exercised.
_TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048, "rope_theta": 10000,
         "max_window_layers": 3, "torch_dtype": "float32", "vocab_size": None, "tie_word_embeddings": True}
_TINY_MOE = {**_TINY, "model_type": "sdar_moe", "architectures": ["SDARMoeForCausalLM"],
             "tie_word_embeddings": False, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [0]}

PRESETS = {
    "tiny_sdar": {**_COMMON, **_TINY},
    "tiny_sdar_moe": {**_COMMON, **_TINY_MOE},
    "sdar_8b": {**_COMMON, **_SDAR_8B},
    "sdar_30b_a3b": {**_COMMON, **_SDAR_30B_A3B},
}
TINY_PRESETS = ("tiny_sdar", "tiny_sdar_moe")
# Block length the checkpoints were trained with (config.json block_size; SDAR's default models use 4).
BLOCK_SIZE = 4


def preset_config(name: str) -> dict:
    if name not in PRESETS:
        raise ValueError(f"unknown SDAR preset {name!r}; choose one of {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])
