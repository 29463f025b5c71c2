"""dInfer's hierarchy decoder: one token per contiguous masked run, plus everything confident."""
from __future__ import annotations

import torch

from fluxlab.engine.decoding.base import Accepted, DecodeBatch, Decoder, masked_scores, most_confident


def hierarchy_accept(score: torch.Tensor, masked: torch.Tensor, threshold: torch.Tensor,
                     low_threshold: torch.Tensor) -> torch.Tensor:
    """In each run of masked positions, its most confident position if above low_threshold; every
    position above threshold; and always the single most confident masked position of the row."""
    starts = masked & ~torch.nn.functional.pad(masked, (1, 0))[:, :-1]
    run_id = torch.where(masked, torch.cumsum(starts.long(), dim=-1), 0)  # 0 = not masked
    run_max = torch.full((score.shape[0], score.shape[1] + 1), -torch.inf, device=score.device, dtype=score.dtype)
    run_max = run_max.scatter_reduce(1, run_id, score, reduce="amax", include_self=True)
    is_run_best = masked & (score == run_max.gather(1, run_id))
    # Keep the first best of each run (ties), so a run gives at most one token: count bests within
    # the run; the count before a run is the minimum of (cumsum - self) over that run.
    seen = torch.cumsum(is_run_best.long(), dim=-1)
    before_run = torch.full_like(run_max, score.shape[1] + 1, dtype=torch.long).scatter_reduce(
        1, run_id, seen - is_run_best.long(), reduce="amin", include_self=True).gather(1, run_id)
    first_best = is_run_best & (seen - before_run == 1)
    accept = (first_best & (score > low_threshold[:, None])) | (score > threshold[:, None])
    return accept | most_confident(score, masked)


class Hierarchy(Decoder):
    name = "hierarchy"
    knobs = ("threshold", "low_threshold")

    def accept(self, batch: DecodeBatch) -> Accepted:
        fill = hierarchy_accept(masked_scores(batch), batch.masked, batch.knobs["threshold"],
                                batch.knobs["low_threshold"])
        return Accepted(fill, torch.zeros_like(fill))

    def finish(self, batch, accepted, masks_left):
        return masks_left == 0, {}
