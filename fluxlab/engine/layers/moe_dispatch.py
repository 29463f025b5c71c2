"""Token dispatch and combine for data-parallel attention (parallel.enable_dp_attention).

Each rank runs attention on its own requests, so the routed experts (split over all ranks) must
see every rank's tokens: `dispatch_tokens` all-gathers each rank's (hidden, chosen experts,
weights), padded to the largest rank's count, as one fp32 tensor (bf16 and expert ids are exact in
fp32); every rank runs its own experts over all of them; `combine_tokens` sums the ranks' fp32
partials and hands each rank back its own rows (reduce-scatter). Padding rows choose expert -1,
which no rank holds, so they cost no expert work.

Every rank joins both collectives in every MoE layer of every forward; a rank with no requests
runs a one-block dummy batch (SGLang does the same), so the counts are never 0. The forward's
counts come from the runner (rank 0 sends them with the step), never from another collective.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class DispatchSizes:
    """The current forward's token count on each rank. None: every rank has as many as this one
    (the memory profile and warm-up forwards, which every rank runs alike)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.counts: Optional[list[int]] = None

    def of(self, num_local: int) -> list[int]:
        counts = self.counts if self.counts is not None else [num_local] * self.world
        if counts[self.rank] != num_local:
            raise RuntimeError(f"DP attention: rank {self.rank} runs {num_local} tokens, the step said {counts[self.rank]}")
        return counts


def dispatch_tokens(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, sizes: DispatchSizes
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's [T, H] tokens and their routing -> every rank's, [world * max T, ...] (padded)."""
    num_tokens, hidden = x.shape
    top_k = topk_idx.shape[1]
    widest = max(sizes.of(num_tokens))
    packed = torch.zeros(widest, hidden + 2 * top_k, dtype=torch.float32, device=x.device)
    packed[:num_tokens, :hidden] = x.float()
    packed[:num_tokens, hidden:hidden + top_k] = topk_idx.float()
    packed[num_tokens:, hidden:hidden + top_k] = -1  # padding: an expert no rank holds
    packed[:num_tokens, hidden + top_k:] = topk_weight.float()
    if packed.is_cuda:
        gathered = torch.empty(sizes.world * widest, packed.shape[1], dtype=packed.dtype, device=packed.device)
        dist.all_gather_into_tensor(gathered, packed)
    else:
        parts = [torch.empty_like(packed) for _ in range(sizes.world)]
        dist.all_gather(parts, packed)
        gathered = torch.cat(parts)
    return (gathered[:, :hidden].to(x.dtype), gathered[:, hidden:hidden + top_k].long(),
            gathered[:, hidden + top_k:].contiguous())


def combine_tokens(partial: torch.Tensor, num_tokens: int, sizes: DispatchSizes) -> torch.Tensor:
    """[world * max T, H] fp32 partial sums of this rank's experts -> this rank's [T, H] totals."""
    widest = partial.shape[0] // sizes.world
    mine = torch.empty(widest, partial.shape[1], dtype=partial.dtype, device=partial.device)
    dist.reduce_scatter(mine, list(partial.contiguous().chunk(sizes.world)))
    return mine[:num_tokens]
