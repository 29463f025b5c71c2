"""argmax and its softmax probability per row of logits, in one pass over the vocabulary.

Greedy decoding needs, per position, the argmax token and its probability exp(max - logsumexp).
Materialising an fp32 copy of [positions, 157184] logits and reducing it twice (max, then
logsumexp) cost ~20% of GPU time at batch 64 (DESIGN §8). The kernel reads the model-dtype logits
once: each program keeps, per lane, an online max, the sum of exp(x - max) and the first index of
the max over its slice of the vocabulary, and merges its lanes at the end; a tiny torch combine
merges the slices. Probability = 1 / sum.

Ties pick the lowest index (torch.max's documented behaviour on CPU), so the kernel and the torch
path agree whenever no two logits are equal within fp32 after the same rounding. fp32 on CPU keeps
the torch path, which the parity tests compare against the reference.
"""
from __future__ import annotations

import torch

from fluxlab.kernels.fused_norm import HAVE_TRITON, _interpret, tl, triton
from fluxlab.kernels.pdl import launch as pdl_launch, start as pdl_start


def greedy_torch(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    top, tokens = logits.max(dim=-1)
    return tokens, torch.exp(top - torch.logsumexp(logits, dim=-1))


if HAVE_TRITON:
    @triton.jit
    def lane_update(lane_max, lane_sum, lane_idx, x, cols):
        """One block of x (masked entries -inf) into per-lane running (max, sum of exp(x - max), first
        column of the max): one exp an element and no cross-lane reduction. A block-wide max, argmax
        and sum per block took 202.6 us at 1024 x 157184 bf16 on the H200, the lanes 170.3 (§21); the
        bytes alone are ~75 us, so the kernel is still not at its memory time."""
        d = x - lane_max
        e = tl.exp(-tl.abs(d))
        e = tl.where(d == d, e, 0.0)  # -inf - -inf: nothing yet on either side
        bigger = x > lane_max
        lane_sum = tl.where(bigger, lane_sum * e + 1.0, lane_sum + e)
        lane_idx = tl.where(bigger, cols, lane_idx)
        return tl.maximum(lane_max, x), lane_sum, lane_idx

    @triton.jit
    def lane_finish(lane_max, lane_sum, lane_idx):
        """The lanes' states -> (max, sum of exp(x - max), lowest column holding the max)."""
        top = tl.max(lane_max, axis=0)
        total = tl.sum(tl.where(lane_max == -float("inf"), 0.0, lane_sum * tl.exp(lane_max - top)), axis=0)
        first = tl.min(tl.where(lane_max == top, lane_idx, 2147483647), axis=0)
        return top, total, first

    @triton.jit
    def lanes_start(BLOCK: tl.constexpr):
        return (tl.full([BLOCK], -float("inf"), tl.float32), tl.zeros([BLOCK], tl.float32),
                tl.zeros([BLOCK], tl.int32))

    @triton.jit
    def _stats_kernel(logits_ptr, stride, vocab, chunk, max_ptr, sum_ptr, idx_ptr, num_splits,
                      BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        row = tl.program_id(0)
        split = tl.program_id(1)
        start = split * chunk
        end = tl.minimum(start + chunk, vocab)
        offs = tl.arange(0, BLOCK)
        lane_max, lane_sum, lane_idx = lanes_start(BLOCK)
        for base in range(start, end, BLOCK):
            cols = base + offs
            x = tl.load(logits_ptr + row * stride + cols, mask=cols < end, other=-float("inf")).to(tl.float32)
            lane_max, lane_sum, lane_idx = lane_update(lane_max, lane_sum, lane_idx, x, cols)
        run_max, run_sum, run_idx = lane_finish(lane_max, lane_sum, lane_idx)
        out = row * num_splits + split
        tl.store(max_ptr + out, run_max)
        tl.store(sum_ptr + out, run_sum)
        tl.store(idx_ptr + out, run_idx)


def split_plan(rows: int, vocab: int, block: int) -> tuple[int, int]:
    """(slices, slice length) of each row's vocabulary: enough programs to fill a GPU (~132 SMs x 4)
    without slices shorter than a few blocks, each slice whole blocks."""
    want = max(1, -(-528 // max(rows, 1)))
    splits = max(1, min(want, vocab // (4 * block)))
    chunk = -(-vocab // splits)
    chunk = -(-chunk // block) * block
    return -(-vocab // chunk), chunk


def combine_parts(part_max: torch.Tensor, part_sum: torch.Tensor, part_idx: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slices' (max, sum of exp, first index of the max) [N, splits] -> (max, log-sum-exp,
    first index of the max) [N] of whole rows: the first slice holding the max wins ties."""
    top, which = part_max.max(dim=-1)
    lse = top + torch.log((part_sum * torch.exp(part_max - top[:, None])).sum(dim=-1))
    return top, lse, part_idx.gather(1, which[:, None]).squeeze(1)


def _kernel_parts(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per vocabulary slice: (max, sum of exp(x - max), first index of the max), each [N, splits]."""
    logits = logits.contiguous()
    rows, vocab = logits.shape
    block = 2048
    splits, chunk = split_plan(rows, vocab, block)
    part_max = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    part_sum = torch.empty_like(part_max)
    part_idx = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    _stats_kernel[(rows, splits)](logits, logits.stride(0), vocab, chunk, part_max, part_sum, part_idx, splits,
                                  BLOCK=block, **pdl_launch())
    return part_max, part_sum, part_idx


def _use_kernel(logits: torch.Tensor) -> bool:
    return HAVE_TRITON and (logits.device.type == "cuda" or _interpret()) and logits.shape[0] > 0


def greedy_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] (any float dtype) -> (argmax [N] int64, probability of it [N] fp32)."""
    if not _use_kernel(logits):
        return greedy_torch(logits)
    part_max, part_sum, part_idx = _kernel_parts(logits)
    top, which = part_max.max(dim=-1)  # the first slice holding the max: the lowest index wins ties
    total = (part_sum * torch.exp(part_max - top[:, None])).sum(dim=-1)
    tokens = part_idx.gather(1, which[:, None]).squeeze(1).long()
    return tokens, 1.0 / total


def shard_stats(logits: torch.Tensor) -> torch.Tensor:
    """A vocabulary shard's statistics for greedy rows: logits [N, V_shard] -> [N, 3] fp32 of
    (max, log-sum-exp, first index of the max). The index travels as fp32, exact below 2**24."""
    assert logits.shape[-1] < 2 ** 24, "argmax index not exact in fp32"
    if _use_kernel(logits):
        top, lse, index = combine_parts(*_kernel_parts(logits))
    else:
        logits = logits.float()
        top, index = logits.max(dim=-1)
        lse = torch.logsumexp(logits, dim=-1)
    return torch.stack([top, lse, index.float()], dim=-1)


def combine_shard_stats(stats: torch.Tensor, shard_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, N, 3] shard statistics (shard s holds vocabulary ids [s * shard_size, (s + 1) * shard_size))
    -> (argmax [N] int64, its probability [N] fp32), as greedy_stats over the whole row: the first
    shard holding the max wins ties, so the lowest index does; log-sum-exp is merged around the max."""
    top, lse, index = stats.unbind(-1)  # each [S, N]
    best, shard = top.max(dim=0)  # first shard with the max
    total_lse = best + torch.log(torch.exp(lse - best[None, :]).sum(dim=0))
    tokens = shard * shard_size + index.gather(0, shard[None, :]).squeeze(0).long()
    return tokens, torch.exp(best - total_lse)
