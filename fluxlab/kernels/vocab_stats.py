"""argmax and its softmax probability per row of logits, in one pass over the vocabulary.

Greedy decoding needs, per position, the argmax token and its probability exp(max - logsumexp).
Materialising an fp32 copy of [positions, 157184] logits and reducing it twice (max, then
logsumexp) cost ~20% of GPU time at batch 64 (DESIGN §8). The kernel reads the model-dtype logits
once: each program keeps an online max, the sum of exp(x - max) and the first index of the max over
its slice of the vocabulary; a tiny torch combine merges the slices. Probability = 1 / sum.

Ties pick the lowest index (torch.max's documented behaviour on CPU), so the kernel and the torch
path agree whenever no two logits are equal within fp32 after the same rounding. fp32 on CPU keeps
the torch path, which the parity tests compare against the reference.
"""
from __future__ import annotations

import torch

from fluxlab.kernels.fused_norm import HAVE_TRITON, _interpret, tl, triton


def greedy_torch(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    top, tokens = logits.max(dim=-1)
    return tokens, torch.exp(top - torch.logsumexp(logits, dim=-1))


if HAVE_TRITON:
    @triton.jit
    def _stats_kernel(logits_ptr, stride, vocab, chunk, max_ptr, sum_ptr, idx_ptr, num_splits,
                      BLOCK: tl.constexpr):
        row = tl.program_id(0)
        split = tl.program_id(1)
        start = split * chunk
        end = tl.minimum(start + chunk, vocab)
        offs = tl.arange(0, BLOCK)
        run_max = -float("inf")
        run_sum = 0.0
        run_idx = 0
        for base in range(start, end, BLOCK):
            cols = base + offs
            x = tl.load(logits_ptr + row * stride + cols, mask=cols < end, other=-float("inf")).to(tl.float32)
            block_max = tl.max(x, axis=0)
            block_idx = tl.argmax(x, axis=0)
            new_max = tl.maximum(run_max, block_max)
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            run_idx = tl.where(block_max > run_max, base + block_idx, run_idx)
            run_max = new_max
        out = row * num_splits + split
        tl.store(max_ptr + out, run_max)
        tl.store(sum_ptr + out, run_sum)
        tl.store(idx_ptr + out, run_idx)


def _num_splits(rows: int, vocab: int, block: int) -> int:
    # Enough programs to fill a GPU (~132 SMs x 4) without slices shorter than a few blocks.
    want = max(1, -(-528 // max(rows, 1)))
    return max(1, min(want, vocab // (4 * block)))


def greedy_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] (any float dtype) -> (argmax [N] int64, probability of it [N] fp32)."""
    if not HAVE_TRITON or (logits.device.type != "cuda" and not _interpret()) or logits.shape[0] == 0:
        return greedy_torch(logits)
    logits = logits.contiguous()
    rows, vocab = logits.shape
    block = 2048
    splits = _num_splits(rows, vocab, block)
    chunk = -(-vocab // splits)
    chunk = -(-chunk // block) * block
    splits = -(-vocab // chunk)
    part_max = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    part_sum = torch.empty_like(part_max)
    part_idx = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    _stats_kernel[(rows, splits)](logits, logits.stride(0), vocab, chunk, part_max, part_sum, part_idx, splits,
                                  BLOCK=block)
    top, which = part_max.max(dim=-1)  # the first slice holding the max: the lowest index wins ties
    total = (part_sum * torch.exp(part_max - top[:, None])).sum(dim=-1)
    tokens = part_idx.gather(1, which[:, None]).squeeze(1).long()
    return tokens, 1.0 / total
