"""Diffusion-Gemma generation at the model level: one request, dense K/V, the engine's canvas step.

It proves the decoder (decoding/canvas.py) against transformers' generate() without the engine's
scheduler, pages or batching in the way; the engine must then give the same tokens in any batch.
Returns transformers' sequences minus the prompt: whole canvases, tokens after the first EOS are
the pad id (as `_finalize_canvas` writes them).
"""
from __future__ import annotations

import math

import torch

from fluxlab.models.diffusion_gemma.decoding import CanvasKnobs, CanvasState, canvas_step
from fluxlab.models.diffusion_gemma.attention import CanvasSegment, DenseCanvasAttention, DenseKV


@torch.no_grad()
def generate_canvases(model, prompt_ids: list[int], max_new_tokens: int, knobs: CanvasKnobs, canvas_length: int,
                      seed: int, eos_ids: tuple[int, ...], pad_id: int) -> tuple[list[int], int]:
    """(new tokens of every canvas, denoiser forwards) for one request."""
    device = model.embed_tokens.weight.device
    vocab = model.embed_tokens.num_embeddings
    kv = DenseKV()
    state = CanvasState(seed, device)

    def run(ids: torch.Tensor, start: int, canvas: bool, soft=None) -> torch.Tensor:
        attn = DenseCanvasAttention([CanvasSegment(kv, len(ids), not canvas)], model.layer_is_sliding,
                                    model.sliding_window)
        positions = torch.arange(start, start + len(ids), device=device)
        is_canvas = torch.full((len(ids),), canvas, dtype=torch.bool, device=device)
        return model(ids, positions, attn, is_canvas, soft)

    out: list[int] = []
    forwards = 0
    start = len(prompt_ids)
    run(torch.tensor(prompt_ids, device=device), 0, canvas=False)
    for _ in range(math.ceil(max_new_tokens / canvas_length)):
        canvas = state.draw_canvas(vocab, canvas_length)
        state.enter_canvas()
        while True:
            logits = model.compute_logits(run(canvas, start, True, state.soft_embeds))
            forwards += 1
            step = canvas_step(logits[None], canvas[None], [state], [knobs])
            canvas = step.block[0]
            if bool(step.final[0]):
                break
            state.soft_embeds = model.soft_embed_probs(step.probs[0])
        committed = canvas.tolist()
        if any(t in eos_ids for t in committed):
            first = min(committed.index(e) for e in eos_ids if e in committed)
            out += committed[:first + 1] + [pad_id] * (canvas_length - first - 1)
            break
        out += committed
        run(canvas, start, canvas=False)  # commit: its K/V joins the cache
        start += canvas_length
    return out, forwards
