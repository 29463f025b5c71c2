"""LLaDA2.0 threshold acceptance with the per-block transfer schedule (DESIGN §5)."""
from __future__ import annotations

import torch


def top_k_per_row(score: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """Boolean [R, bl]: the k[r] highest scores of row r (k may differ per row; k_max >= max k,
    known on the host, so no device->host sync is needed)."""
    chosen = torch.zeros_like(score, dtype=torch.bool)
    if k_max == 0:
        return chosen
    idx = torch.topk(score, k_max, dim=-1).indices
    keep = torch.arange(k_max, device=score.device)[None, :] < k[:, None]
    return chosen.scatter(1, idx, keep)


def threshold_accept(conf: torch.Tensor, masked: torch.Tensor, threshold: torch.Tensor,
                     k: torch.Tensor, k_max: int) -> torch.Tensor:
    """Among masked positions: all above threshold if at least k[r] are, else the top-k[r]."""
    score = torch.where(masked, conf, torch.full_like(conf, -torch.inf))
    high = score > threshold[:, None]
    k = torch.minimum(k, masked.sum(dim=-1))
    enough = high.sum(dim=-1) >= k
    return torch.where(enough[:, None], high, top_k_per_row(score, k, k_max) & masked)
