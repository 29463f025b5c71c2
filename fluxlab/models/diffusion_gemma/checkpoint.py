"""`fluxlab checkpoint preset=tiny_diffusion_gemma`: a tiny random Diffusion-Gemma checkpoint.

Built by transformers' own DiffusionGemmaForBlockDiffusion and written with its `save_pretrained`,
so names, tying and config.json are exactly transformers' layout. The tokenizer is fluxlab's tiny
byte-level BPE (its ~4.1k ids fit a tiny vocab); <|endoftext|> is eos, pad and bos.
The text config leaves `use_bidirectional_attention` unset: with "all", transformers 5.24's
generate() fails ("multiple values for keyword argument 'is_causal'"), and that generate() is the
parity target.
"""
from __future__ import annotations

from pathlib import Path

PRESET = "tiny_diffusion_gemma"
CANVAS_LENGTH = 8
SLIDING_WINDOW = 8  # smaller than a prompt + canvas, so the window limits matter in tests

# Sliding, full, sliding, full: two of each type, the last full (Gemma-4 requires it). Full layers
# get their own head_dim / KV heads (global_head_dim, num_global_key_value_heads), as the 26B-A4B has.
TINY_TEXT_CONFIG = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=SLIDING_WINDOW,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    num_experts=4, top_k_experts=2, moe_intermediate_size=32, max_position_embeddings=512,
    final_logit_softcapping=30.0,
)
# The vision tower is unused by text serving but always built by transformers; keep it minimal.
TINY_VISION_CONFIG = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2, head_dim=8, position_embedding_size=64)
# transformers' random init gives near-uniform logits: every canvas position's entropy is ~log(vocab)
# and they tie to fp32 rounding, so which position the sampler accepts first is a coin flip between
# two correct implementations. Scaling the tied embedding (and so the head) spreads the entropies
# (about 0.05-4 nats) and lets early stopping trigger, so exactness tests test the algorithm.
EMBED_PEAK = 20.0
# Denoising knobs of the tiny checkpoint's generation_config.json (the 26B-A4B's own are not public here).
# Random weights never repeat an argmax canvas (renoised tokens move every prediction), so stability is
# off (0: transformers then stops on confidence alone) and the confidence bound is where the mean
# entropy ends (1-2 nats): some canvases stop early. tests/test_canvas_decoding.py checks the
# stability rule against transformers' StableAndConfidentStoppingCriteria directly.
TINY_GENERATION = dict(max_denoising_steps=8, entropy_bound=1.0, t_min=0.4, t_max=1.0, stability_threshold=0,
                       confidence_threshold=1.5)


def write_diffusion_gemma_checkpoint(out, seed: int = 0, dtype: str = "float32") -> Path:
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (DiffusionGemmaGenerationConfig,
                                                                                 EntropyBoundSamplerConfig)

    from fluxlab.checkpoint import _tiny_special_ids, train_tokenizer, tokenizer_files
    from fluxlab.engine.weights import resolve_dtype

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    special_ids = _tiny_special_ids()
    eos = special_ids["<|endoftext|>"]
    text = dict(TINY_TEXT_CONFIG, vocab_size=max(special_ids.values()) + 1, pad_token_id=eos, eos_token_id=eos,
                bos_token_id=eos)
    config = DiffusionGemmaConfig(text_config=text, vision_config=TINY_VISION_CONFIG, canvas_length=CANVAS_LENGTH)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DiffusionGemmaForBlockDiffusion(config).to(resolve_dtype(dtype)).eval()
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(EMBED_PEAK)  # tied: encoder, decoder and head
    g = dict(TINY_GENERATION)
    model.generation_config = DiffusionGemmaGenerationConfig(
        max_denoising_steps=g["max_denoising_steps"], sampler_config=EntropyBoundSamplerConfig(g["entropy_bound"]),
        t_min=g["t_min"], t_max=g["t_max"], stability_threshold=g["stability_threshold"],
        confidence_threshold=g["confidence_threshold"], eos_token_id=eos, pad_token_id=eos, bos_token_id=eos)
    model.save_pretrained(str(out))
    for name, content in tokenizer_files(special_ids, text["max_position_embeddings"], train_tokenizer()).items():
        (out / name).write_text(content, encoding="utf-8")
    return out
