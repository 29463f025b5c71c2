"""Sampling proposals (temperature > 0): the filtered distribution a row draws from, on the device.
Greedy rows take argmax and its probability from fluxlab/kernels/vocab_stats.py."""
from __future__ import annotations

import torch


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p (keeping the token that crosses top_p), then softmax."""
    logits = logits / temperature
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
