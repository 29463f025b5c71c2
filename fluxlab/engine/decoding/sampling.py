"""Sampling proposals (temperature > 0): the filtered distribution a row draws from, on the device.
Greedy rows take argmax and its probability from fluxlab/kernels/vocab_stats.py."""
from __future__ import annotations

import torch


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p (keeping the token that crosses top_p), then softmax.

    Every positive temperature works. The logits are shifted so their maximum is 0 before the
    division (softmax is shift-invariant), so a tiny temperature sends the others to -inf instead of
    the maximum to +inf (inf - inf is the NaN that made temperature=1e-300 fail a step), and the
    divisor is at least the dtype's smallest normal number (1e-300 is 0 in float32): below ~1e-30
    every gap between logits already divides to -inf, so the result is the limit, the argmax with
    probability 1 (ties shared), exactly as for any smaller temperature."""
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, torch.finfo(logits.dtype).tiny)
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True, dim=-1)
        drop = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1) > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, sorted_idx, drop), float("-inf"))
    return torch.softmax(logits, dim=-1)
