"""Token proposals and their confidences from one forward's logits, on the device."""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax and its softmax probability over the full vocabulary, without a materialised softmax."""
    top, tokens = logits.max(dim=-1)
    conf = torch.exp(top - torch.logsumexp(logits, dim=-1))
    return tokens, conf


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


def propose(logits: torch.Tensor, temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float],
            generators: Sequence[Optional[torch.Generator]]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, bl, V] fp32 -> (tokens [R, bl], confidence [R, bl]).

    Greedy rows (temperature 0) are done in one batched pass. A sampling row draws from its own
    generator, so its tokens do not depend on which requests share the batch.
    """
    tokens, conf = greedy(logits)
    for r, temp in enumerate(temperature):
        if temp > 0:
            probs = filtered_probs(logits[r], temp, top_k[r], top_p[r])
            sampled = torch.multinomial(probs, 1, generator=generators[r]).squeeze(-1)
            tokens[r] = sampled
            conf[r] = probs.gather(-1, sampled[:, None]).squeeze(-1)
    return tokens, conf
