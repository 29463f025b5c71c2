"""Diffusion-Gemma shapes for `model.load_format=random` (speed work without the weights).

google/diffusiongemma-26B-A4B-it's config.json is not reachable here; every number below is taken
from public pages, named beside it (read 2026-12-01):
  [ollama]   ollama.com/library/gemma4:26b-a4b-it-q4_K_M (GGUF metadata of the Gemma-4 26B-A4B backbone)
  [megatron] docs.nvidia.com/nemo/megatron-bridge .../bridge.models.gemma.gemma4_provider.html
  [sglang]   docs.sglang.io/cookbook/autoregressive/Google/DiffusionGemma (spec table)
  [vllm]     vllm-project.github.io/2026/06/10/diffusion-gemma.html and recipes.vllm.ai/Google/diffusiongemma-26B-A4B-it
  [hf]       transformers 5.24 DiffusionGemmaTextConfig / DiffusionGemmaConfig defaults (the class docstring
             names this checkpoint)
DiffusionGemma is the Gemma-4 26B-A4B backbone run as encoder and decoder with tied weights [vllm],
so the backbone's shapes are the model's.
"""
from __future__ import annotations

import copy

import torch

DIFFUSION_GEMMA_26B_A4B = {
    "canvas_length": 256,  # [vllm] "denoises a canvas of 256 tokens"; [sglang] Canvas Length 256; [hf] default
    "text_config": {
        "vocab_size": 262144,  # [sglang] "262K"; [hf] default 262_144
        "hidden_size": 2816,  # [ollama] embedding_length
        "intermediate_size": 2112,  # [ollama] feed_forward_length (the dense MLP beside the experts)
        "num_hidden_layers": 30,  # [ollama] block_count; [sglang] Layers 30
        "num_attention_heads": 16,  # [ollama] head_count
        "num_key_value_heads": 8,  # [ollama] head_count_kv (sliding layers); [megatron] 8 KV heads
        "head_dim": 256,  # [ollama] key_length_swa; [megatron] sliding head_dim=256
        "global_head_dim": 512,  # [ollama] key_length; [megatron] global_head_dim=512
        "num_global_key_value_heads": 2,  # [megatron] global layers 2 KV heads (K=V shared)
        "sliding_window": 1024,  # [ollama] sliding_window; [sglang] Sliding Window 1024
        "num_experts": 128,  # [ollama] expert_count; [vllm] 128 experts
        "top_k_experts": 8,  # [ollama] expert_used_count; [vllm] top-8 routing
        "moe_intermediate_size": 704,  # [ollama] expert_feed_forward_length
        "max_position_embeddings": 262144,  # [ollama] context_length; [sglang] up to 256K
        "rms_norm_eps": 1e-6,  # [ollama] layer_norm_rms_epsilon
        "final_logit_softcapping": 30.0,  # [ollama] final_logit_softcapping
        "hidden_activation": "gelu_pytorch_tanh",  # [hf] default (Gemma's GeGLU)
        # [hf] default rope_parameters; [ollama] rope freq_base 1e6 (full) / 1e4 (sliding), rope dims
        # 512 / 256; [megatron] partial rotary 0.25 on global layers
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
        # Not seen in full for this checkpoint: [ollama]'s sliding_window_pattern array is shown
        # truncated ("true, true, true, true, true, ..."); the Gemma-4 pattern of 5 sliding layers then
        # one full layer is [hf]'s default (sliding_window_pattern = 6, last layer full), which this takes.
        "layer_types": None,
        "eos_token_id": 1, "pad_token_id": 0, "bos_token_id": 2,  # [hf] defaults (Gemma's ids)
    },
}
# Generation config: [vllm] recipe: up to 48 steps per block, entropy_bound 0.1. t_min, t_max,
# stability_threshold and confidence_threshold of the checkpoint are not public here: random runs use
# transformers' global defaults (decoding/canvas.py TRANSFORMERS_DEFAULTS), whose 48 and 0.1 agree.

PRESETS = {"diffusion_gemma_26b_a4b": DIFFUSION_GEMMA_26B_A4B}


def preset_text_config(name: str):
    """transformers' DiffusionGemmaTextConfig of a preset (its own parsing: per-layer head dims, KV heads)."""
    from transformers import DiffusionGemmaConfig

    if name not in PRESETS:
        raise ValueError(f"model.preset={name!r} has no Diffusion-Gemma shapes; use one of {sorted(PRESETS)}")
    preset = copy.deepcopy(PRESETS[name])
    text = {k: v for k, v in preset["text_config"].items() if v is not None}
    return DiffusionGemmaConfig(text_config=text, canvas_length=preset["canvas_length"]).text_config


@torch.no_grad()
def build_random_diffusion_gemma(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """DiffusionGemmaModel of the preset's shapes with random weights made on the device (uniform,
    std 0.02; norms, scales and layer scalars one), for speed work only."""
    from fluxlab.models.diffusion_gemma.model import DiffusionGemmaModel, rope_inv_freqs

    text_config = preset_text_config(name)
    with torch.device("meta"):
        model = DiffusionGemmaModel(text_config).to(dtype)  # never a full fp32 copy (26B: 100 GB)
    model = model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name_, param in model.named_parameters():
        if param.dim() == 1:  # norm weights, router scales
            param.fill_(1.0)
        else:
            param.uniform_(-0.02 * 3 ** 0.5, 0.02 * 3 ** 0.5, generator=generator)
    for layer in model.layers:
        layer.layer_scalar.fill_(1.0)
        layer.encoder_layer_scalar.fill_(1.0)
    for layer_type, inv_freq in rope_inv_freqs(text_config).items():
        setattr(model, f"{layer_type}_inv_freq", inv_freq.to(device))
    return model.eval()
