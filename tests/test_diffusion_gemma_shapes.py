"""Diffusion-Gemma parity is a property over checkpoint shapes, not of the tiny preset.

Each shape below is a checkpoint written by transformers' own DiffusionGemmaForBlockDiffusion
(`save_pretrained`, random init, every 2-D text weight scaled so the entropy-bound sampler accepts
several tokens a step). For every request, fluxlab's tokens equal what
`torch.manual_seed(seed); model.generate(ids, max_new_tokens=n)` gives (CPU, fp32) when the request
runs alone, and again inside one mixed batch whose page budget forces preemption.

The shapes cover: sliding window smaller than, equal to, a multiple of, and larger than (not a
multiple of) the canvas, and larger than several canvases; full-attention layers with their own
head_dim / KV heads (global_head_dim, num_global_key_value_heads, an explicit per_layer_config,
attention_k_eq_v off), GQA and MHA; 2-6 layers in several sliding/full patterns (a full first
layer too); 1..all of 4-16 experts routed; soft-caps that bind hard or barely; tied and untied
weights (transformers' tie_word_embeddings=False unties the encoder from the decoder and the head
from the embedding); proportional RoPE with other partial factors and thetas; vocab sizes; prompts
of 1 to ~3 windows; max_new_tokens not a multiple of the canvas; paged and dynamic policies.
transformers cannot run a dense (no-MoE) layer or soft-cap off (its layers always route, its head
divides by the cap), so those are not shapes here.
"""
from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field

import pytest
import torch

from fluxlab.engine.request import SamplingParams

SLIDING, FULL = "sliding_attention", "full_attention"
VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=2, head_dim=8, position_embedding_size=64)


@dataclass(frozen=True)
class Shape:
    name: str
    text: dict  # DiffusionGemmaTextConfig kwargs (vocab_size and ids added below)
    canvas: int
    vocab: int
    requests: tuple  # (prompt length, seed, max_new_tokens)
    tie: bool = True
    scale: float = 3.0  # every 2-D text weight
    peak: float = 12.0  # embeddings and head once more: peaked logits, so several tokens are accepted a step
    policy: str = "paged"
    generation: dict = field(default_factory=lambda: dict(
        max_denoising_steps=6, entropy_bound=1.0, t_min=0.4, t_max=1.0, stability_threshold=0,
        confidence_threshold=1.0))


def _moe(experts, top_k, inter=16):
    return dict(num_experts=experts, top_k_experts=top_k, moe_intermediate_size=inter)


SHAPES = [
    # The shape: window 11 > canvas 4 and not a multiple, full layers 32-dim x 1 KV head,
    # 6 layers sliding:full 2:1, top-2 of 8.
    Shape("window_gt_canvas_2to1", dict(
        hidden_size=48, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, global_head_dim=32, num_global_key_value_heads=1, sliding_window=11,
        layer_types=[SLIDING, SLIDING, FULL] * 2, final_logit_softcapping=30.0, **_moe(8, 2)),
        canvas=4, vocab=512, requests=((1, 0, 9), (6, 1, 10), (13, 2, 7), (30, 3, 13))),
    # Window < canvas; a full first layer; top-1; a hard soft-cap; untied; no per-type rope override.
    Shape("window_lt_canvas_untied", dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, global_head_dim=16, sliding_window=3, layer_types=[FULL, SLIDING, FULL],
        final_logit_softcapping=4.0, **_moe(4, 1)),
        canvas=6, vocab=700, tie=False, generation=dict(
            max_denoising_steps=6, entropy_bound=6.0, t_min=0.4, t_max=1.0, stability_threshold=0,
            confidence_threshold=1.5), requests=((2, 4, 23), (5, 5, 19), (9, 6, 13), (14, 7, 17))),
    # Window a multiple of the canvas (3 canvases); MHA sliding layers, full layers 2 KV heads of 24;
    # every expert routed; dynamic policy (prompt chunks beside canvases).
    Shape("window_3_canvases_mha", dict(
        hidden_size=40, intermediate_size=40, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
        head_dim=20, global_head_dim=24, num_global_key_value_heads=2, sliding_window=12,
        layer_types=[SLIDING, FULL, SLIDING, FULL], final_logit_softcapping=30.0, **_moe(4, 4)),
        canvas=4, vocab=384, policy="dynamic", requests=((3, 8, 14), (11, 9, 9), (25, 10, 6), (36, 11, 10))),
    # Window = canvas + 1; the smallest model (2 layers); explicit per_layer_config for the full layer;
    # proportional RoPE at another factor / theta; a large vocab.
    Shape("window_canvas_plus_1_per_layer_config", dict(
        hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, sliding_window=6, layer_types=[SLIDING, FULL], per_layer_config={1: dict(
            head_dim=16, num_key_value_heads=4)}, final_logit_softcapping=15.0, rope_parameters={
            SLIDING: dict(rope_type="default", rope_theta=500.0),
            FULL: dict(rope_type="proportional", partial_rotary_factor=0.5, rope_theta=50000.0)}, **_moe(16, 3)),
        canvas=5, vocab=4200, generation=dict(
            max_denoising_steps=6, entropy_bound=12.0, t_min=0.4, t_max=1.0, stability_threshold=0,
            confidence_threshold=4.0), requests=((1, 12, 17), (4, 13, 16), (8, 14, 8), (16, 15, 11))),
    # Window far larger than the canvas (5.5 canvases); 5 layers; full layers share the sliding KV
    # heads (attention_k_eq_v off keeps num_key_value_heads), untied, stability rule on.
    Shape("wide_window_untied_k_eq_v_off", dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=1,
        head_dim=8, global_head_dim=16, num_global_key_value_heads=4, attention_k_eq_v=False, sliding_window=11,
        layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL], final_logit_softcapping=30.0, **_moe(8, 2)),
        canvas=2, vocab=300, tie=False, generation=dict(
            max_denoising_steps=5, entropy_bound=0.5, t_min=0.3, t_max=0.9, stability_threshold=1,
            confidence_threshold=2.0),
        requests=((1, 16, 7), (7, 17, 5), (12, 18, 9), (23, 19, 4))),
    # Window = canvas (the tiny preset's ratio) at other dims, the default 5:1 pattern cut to 6 layers
    # (transformers forces the last layer full), 3 of 6 experts.
    Shape("window_eq_canvas_5to1", dict(
        hidden_size=32, intermediate_size=32, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=7, layer_types=None,
        final_logit_softcapping=30.0, **_moe(6, 3)),
        canvas=7, vocab=512, policy="dynamic", requests=((1, 20, 15), (8, 21, 8), (15, 22, 20), (20, 23, 13))),
    # Window 9 vs canvas 4 with a 3-layer all-sliding-then-full stack, mild scale: fewer accepts,
    # more steps per canvas, the transformers default step count cut to 10.
    Shape("window_9_canvas_4_mild", dict(
        hidden_size=48, intermediate_size=48, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1,
        head_dim=16, global_head_dim=16, num_global_key_value_heads=3, sliding_window=9,
        layer_types=[SLIDING, SLIDING, FULL], final_logit_softcapping=30.0, **_moe(8, 2)),
        canvas=4, vocab=256, scale=2.0, generation=dict(
            max_denoising_steps=10, entropy_bound=0.3, t_min=0.4, t_max=0.8, stability_threshold=2,
            confidence_threshold=0.5),
        requests=((2, 24, 9), (10, 25, 6), (19, 26, 11), (27, 27, 3))),
]
EOS = 3  # inside every vocab; pad and bos too


def write_checkpoint(shape: Shape, out):
    """transformers' own model of this shape, saved by `save_pretrained`, with a generation_config
    and the tiny Diffusion-Gemma checkpoint's tokenizer (the engine loads one)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (DiffusionGemmaGenerationConfig,
                                                                                 EntropyBoundSamplerConfig)

    from fluxlab.checkpoint import ensure_tiny_checkpoint

    text = {k: v for k, v in shape.text.items() if v is not None}
    text.update(vocab_size=shape.vocab, max_position_embeddings=1024, eos_token_id=EOS, pad_token_id=EOS,
                bos_token_id=EOS)
    config = DiffusionGemmaConfig(text_config=text, vision_config=VISION, canvas_length=shape.canvas,
                                  tie_word_embeddings=shape.tie)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(sum(map(ord, shape.name)))
        model = DiffusionGemmaForBlockDiffusion(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied tensors once (named_parameters dedups)
            if param.dim() == 2 and ".vision_tower." not in name and ".embed_vision." not in name:
                param.mul_(shape.scale * (shape.peak if "embed_tokens" in name or "lm_head" in name else 1.0))
    g = shape.generation
    model.generation_config = DiffusionGemmaGenerationConfig(
        max_denoising_steps=g["max_denoising_steps"], sampler_config=EntropyBoundSamplerConfig(g["entropy_bound"]),
        t_min=g["t_min"], t_max=g["t_max"], stability_threshold=g["stability_threshold"],
        confidence_threshold=g["confidence_threshold"], eos_token_id=EOS, pad_token_id=EOS, bos_token_id=EOS)
    model.save_pretrained(str(out))
    tokenizer_dir = ensure_tiny_checkpoint(preset="tiny_diffusion_gemma")
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(7919 * n + seed)).tolist()


def transformers_tokens(hf, prompt: list[int], seed: int, max_new_tokens: int) -> tuple[list[int], str, int, list]:
    """(tokens cut at max_new_tokens and before EOS, finish reason, decoder forwards, positions the
    sampler accepted at each step) of transformers' generate() for this request alone."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSampler

    forwards, accepted = 0, []
    forward, accept = hf.forward, EntropyBoundSampler.accept_canvas

    def counted(*args, **kwargs):
        nonlocal forwards
        forwards += 1
        return forward(*args, **kwargs)

    def recorded(self, *args, **kwargs):
        out = accept(self, *args, **kwargs)
        accepted.append(int(self.accepted_token_mask.sum()))
        return out

    hf.forward, EntropyBoundSampler.accept_canvas = counted, recorded
    try:
        torch.manual_seed(seed)
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens)
    finally:
        del hf.forward
        EntropyBoundSampler.accept_canvas = accept
    new = out.sequences[0, len(prompt):len(prompt) + max_new_tokens].tolist()
    if EOS in new:
        return new[:new.index(EOS)], "stop", forwards, accepted
    return new, "length", forwards, accepted


def pages_needed(shape: Shape, prompt_len: int, max_new: int) -> int:
    L = shape.canvas
    return math.ceil(prompt_len / L) + math.ceil(max_new / L)


@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_tokens_equal_transformers_alone_and_in_a_preempted_batch(shape, tmp_path, one_thread):
    from transformers import DiffusionGemmaForBlockDiffusion

    from fluxlab.llm import LLM

    path = write_checkpoint(shape, tmp_path / shape.name)
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), dtype=torch.float32).eval()
    cases = [(prompt_ids(n, seed, shape.vocab), seed, m) for n, seed, m in shape.requests]
    want = [transformers_tokens(hf, p, s, m) for p, s, m in cases]
    accepted = [a for *_, steps in want for a in steps]
    assert sum(accepted) / len(accepted) >= min(2.0, 0.6 * shape.canvas), shape.name  # several accepted a step

    L = shape.canvas
    budget = max(pages_needed(shape, len(p), m) for p, _, m in cases)  # the longest fits alone, not beside others
    max_len = L * (budget + 2)
    llm = LLM(overrides=[
        "model=tiny_diffusion_gemma", f"model.path={path}", "model.preset=null", f"decoding.canvas_length={L}",
        f"model.max_model_len={max_len}", f"model.max_new_tokens={L}", "engine.dtype=float32", "engine.device=cpu",
        f"scheduler={shape.policy}",
        "scheduler.max_num_seqs=4", f"scheduler.max_scheduled_tokens={4 * L}", f"scheduler.num_device_pages={budget}",
        "scheduler.enable_prefix_cache=false"])
    engine = llm.engine

    def check(results, label):
        for (prompt, seed, n), (tokens, reason, forwards, _), got in zip(cases, want, results):
            where = (shape.name, label, len(prompt), seed, n)
            assert got.token_ids == tokens, where
            assert got.finish_reason == reason, where
            assert got.stats.forwards == forwards, where
        assert engine.kv_free_pages == engine.kv_total_pages
        engine.check_pages()
        assert not engine.has_unfinished()

    alone = [llm.generate([p], [SamplingParams(max_new_tokens=m, seed=s)])[0] for p, s, m in cases]
    check(alone, "alone")
    batch = llm.generate([p for p, _, _ in cases], [SamplingParams(max_new_tokens=m, seed=s) for _, s, m in cases])
    check(batch, "batch")
    assert sum(r.stats.preemptions for r in batch) > 0, shape.name


def test_a_tied_checkpoint_whose_copies_differ_is_refused(tmp_path):
    """transformers does not tie a tensor stored twice with different values; fluxlab's one module
    cannot hold both, so the loader names it instead of keeping either silently."""
    from safetensors.torch import load_file, save_file

    from fluxlab.models.diffusion_gemma.loader import load_diffusion_gemma

    shape = next(s for s in SHAPES if s.tie and s.text["num_hidden_layers"] == 2)
    path = write_checkpoint(shape, tmp_path / "tied")
    tensors = load_file(str(path / "model.safetensors"))
    assert "lm_head.weight" not in tensors  # save_pretrained wrote the tied head once
    load_diffusion_gemma(path)
    tensors["lm_head.weight"] = tensors["model.decoder.embed_tokens.weight"] * 2
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="differs from the tensor it is tied to"):
        load_diffusion_gemma(path)


def test_a_canvas_length_other_than_the_checkpoints_is_flagged(tmp_path, caplog):
    from fluxlab.models.diffusion_gemma.engine import _warn_on_canvas_mismatch

    (tmp_path / "config.json").write_text('{"model_type": "diffusion_gemma", "canvas_length": 16}')
    with caplog.at_level("WARNING", logger="fluxlab.engine"):
        _warn_on_canvas_mismatch(tmp_path, 16)
        assert not caplog.records
        _warn_on_canvas_mismatch(tmp_path, 8)
    assert "decoding.canvas_length=16" in caplog.text.split("set ")[-1]
