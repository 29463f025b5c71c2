"""LLaDA2.0 threshold acceptance with the per-block transfer schedule (DESIGN §5)."""
from __future__ import annotations

import torch

from fluxlab.engine.decoding.base import Accepted, DecodeBatch, Decoder, masked_scores


def transfer_counts(block_length: int, steps: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """k[s] of the schedule: block_length // steps each, the first block_length % steps steps one
    more; steps past the schedule keep its last count."""
    base = block_length // steps
    return base + (step < block_length % steps).long()


def top_k_per_row(score: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Boolean [R, bl]: the k[r] highest scores of row r (ties: topk's order, as the reference)."""
    k_max = score.shape[-1]
    idx = torch.topk(score, k_max, dim=-1).indices
    keep = torch.arange(k_max, device=score.device)[None, :] < k[:, None]
    return torch.zeros_like(score, dtype=torch.bool).scatter(1, idx, keep)


class Threshold(Decoder):
    name = "threshold"
    knobs = ("threshold", "steps")
    state = ("step",)

    def accept(self, batch: DecodeBatch) -> Accepted:
        """Among masked positions: all above threshold if at least k[s] are, else the top-k[s]."""
        score = masked_scores(batch)
        high = score > batch.knobs["threshold"][:, None]
        k = transfer_counts(score.shape[-1], batch.knobs["effective_steps"], batch.state["step"])
        k = torch.minimum(k, batch.masked.sum(dim=-1))
        enough = high.sum(dim=-1) >= k
        fill = torch.where(enough[:, None], high, top_k_per_row(score, k) & batch.masked)
        return Accepted(fill, torch.zeros_like(fill))

    def finish(self, batch, accepted, masks_left):
        return masks_left == 0, {"step": batch.state["step"] + 1}
