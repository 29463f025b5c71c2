"""The canvas sampler's per-position statistics in two passes over the head's raw logits (CUDA).

Per canvas position the entropy-bound sampler needs, of processed = cap * tanh(raw / cap) / T:
the argmax, the softmax probabilities (the multinomial's input and the self-conditioning input)
and the entropy. The torch ops transformers runs (decoding/canvas.py, kept on CPU where they are
the definition of right) make ~30 fp32 passes over [rows, 256, 262144] (soft-cap, temperature,
softmax, logsumexp, Categorical's normalise / softmax / clamp / product / sum); at batch 64 that is
~16 GiB a pass. Here the raw model-dtype logits are read twice, the noise once, and the
probabilities written once in the model dtype; soft-cap and temperature are applied on the fly:

1. `_max_kernel` (grid rows x vocabulary slices): online max, sum of exp(x - max), first index of
   the max per slice; a small torch combine gives log-sum-exp and the argmax (lowest index on ties).
2. `_probs_kernel` (same grid): p = exp(x - lse) stored in the model dtype (the self-conditioning
   input), the slice's sum of p * (lse - x) (Categorical's -sum(p * log p) term by term: no
   lse - E[x] cancellation at small entropies), and the multinomial's draw argmax(p / q) over the
   Exp(1) noise the caller drew from the request's generator (torch.multinomial's one-sample path,
   so the generator is consumed as there) without writing p / q.

Values agree with the torch path to fp32 rounding, not bit for bit (tanh from exp, another
reduction order), which is why CPU keeps the torch ops.

Batch invariance: a position's numbers must not depend on how many rows share the call, so each
row's vocabulary is cut into a number of slices that depends on the vocabulary alone (`SPLITS`),
and the slices are combined by elementwise ops in slice order (`_combine`): no torch reduction,
whose blocking may change with the number of rows.
"""
from __future__ import annotations

import torch

from fluxlab.kernels.fused_norm import HAVE_TRITON, _interpret, tl, triton
from fluxlab.kernels.pdl import launch as pdl_launch, start as pdl_start

if HAVE_TRITON:
    from fluxlab.kernels.vocab_stats import lane_finish, lane_update, lanes_start

BLOCK = 2048
# Slices of a row's vocabulary, fixed (batch invariance). 4 x 65536 at 262144 ids: a 256-position
# canvas alone is 1024 programs (~8 per SM of an H200).
SPLITS = 4

if HAVE_TRITON:
    @triton.jit
    def _processed(raw_ptr, row, stride, cols, mask, cap, inv_cap, temperature, HAS_CAP: tl.constexpr):
        x = tl.load(raw_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_CAP:
            y = x * inv_cap
            x = cap * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))  # cap * tanh(x / cap)
        return x / temperature

    @triton.jit
    def _max_kernel(raw_ptr, stride, vocab, chunk, temp_ptr, cap, inv_cap, max_ptr, sum_ptr, idx_ptr, num_splits,
                    HAS_CAP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        row = tl.program_id(0)
        split = tl.program_id(1)
        start = split * chunk
        end = tl.minimum(start + chunk, vocab)
        temperature = tl.load(temp_ptr + row)
        offs = tl.arange(0, BLOCK)
        lane_max, lane_sum, lane_idx = lanes_start(BLOCK)
        for base in range(start, end, BLOCK):
            cols = base + offs
            mask = cols < end
            x = _processed(raw_ptr, row, stride, cols, mask, cap, inv_cap, temperature, HAS_CAP)
            x = tl.where(mask, x, -float("inf"))
            lane_max, lane_sum, lane_idx = lane_update(lane_max, lane_sum, lane_idx, x, cols)
        run_max, run_sum, run_idx = lane_finish(lane_max, lane_sum, lane_idx)
        out = row * num_splits + split
        tl.store(max_ptr + out, run_max)
        tl.store(sum_ptr + out, run_sum)
        tl.store(idx_ptr + out, run_idx)

    @triton.jit
    def _probs_kernel(raw_ptr, stride, vocab, chunk, temp_ptr, cap, inv_cap, lse_ptr, probs_ptr, ent_ptr,
                      noise_ptr, ratio_ptr, sample_ptr, num_splits, HAS_CAP: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr = False):
        pdl_start(PDL)
        row = tl.program_id(0)
        split = tl.program_id(1)
        start = split * chunk
        end = tl.minimum(start + chunk, vocab)
        temperature = tl.load(temp_ptr + row)
        lse = tl.load(lse_ptr + row)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        run_ratio = -float("inf")
        run_idx = 0
        for base in range(start, end, BLOCK):
            cols = base + offs
            mask = cols < end
            x = _processed(raw_ptr, row, stride, cols, mask, cap, inv_cap, temperature, HAS_CAP)
            p = tl.exp(x - lse)
            tl.store(probs_ptr + row * vocab + cols, p.to(probs_ptr.dtype.element_ty), mask=mask)
            acc += tl.where(mask, p * (lse - x), 0.0)
            # torch.multinomial's one-sample draw: argmax(p / q), q ~ Exp(1) drawn beforehand
            q = tl.load(noise_ptr + row * vocab + cols, mask=mask, other=1.0)
            ratio = tl.where(mask, p / q, -float("inf"))
            block_ratio = tl.max(ratio, axis=0)
            block_idx = tl.argmax(ratio, axis=0)
            run_idx = tl.where(block_ratio > run_ratio, base + block_idx, run_idx)
            run_ratio = tl.maximum(run_ratio, block_ratio)
        out = row * num_splits + split
        tl.store(ent_ptr + out, tl.sum(acc, axis=0))
        tl.store(ratio_ptr + out, run_ratio)
        tl.store(sample_ptr + out, run_idx)


def use_kernel(raw: torch.Tensor) -> bool:
    return HAVE_TRITON and (raw.device.type == "cuda" or _interpret())


def canvas_stats(raw: torch.Tensor, temperature: torch.Tensor, softcap: float | None, noise: torch.Tensor,
                 probs_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw [N, V] head output (any float dtype), temperature [N] fp32, noise [N, V] fp32 Exp(1)
    draws -> (argmax [N] int64, entropy [N] fp32, probabilities [N, V] in probs_dtype, sample [N]
    int64 = argmax(p / noise)) of processed = cap * tanh(raw / cap) / temperature."""
    raw = raw.contiguous()
    rows, vocab = raw.shape
    assert rows * vocab < 2**31, "int32 offsets: chunk the rows (the runner's step_elements does)"
    chunk = -(-vocab // SPLITS)
    chunk = -(-chunk // BLOCK) * BLOCK
    splits = -(-vocab // chunk)
    device = raw.device
    cap = float(softcap) if softcap else 1.0
    temperature = temperature.contiguous()
    part_max = torch.empty(rows, splits, dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    part_idx = torch.empty(rows, splits, dtype=torch.int32, device=device)
    _max_kernel[(rows, splits)](raw, raw.stride(0), vocab, chunk, temperature, cap, 1.0 / cap, part_max, part_sum,
                                part_idx, splits, HAS_CAP=bool(softcap), BLOCK=BLOCK, **pdl_launch())
    lse, argmax = _combine_max(part_max, part_sum, part_idx)  # the lowest index wins ties
    probs = torch.empty(rows, vocab, dtype=probs_dtype, device=device)
    part_entropy = torch.empty(rows, splits, dtype=torch.float32, device=device)
    part_ratio = torch.empty_like(part_entropy)
    part_sample = torch.empty(rows, splits, dtype=torch.int32, device=device)
    _probs_kernel[(rows, splits)](raw, raw.stride(0), vocab, chunk, temperature, cap, 1.0 / cap, lse, probs,
                                  part_entropy, noise.contiguous(), part_ratio, part_sample, splits,
                                  HAS_CAP=bool(softcap), BLOCK=BLOCK, **pdl_launch())
    sample, entropy = part_sample[:, 0].long(), part_entropy[:, 0]
    best = part_ratio[:, 0]
    for s in range(1, splits):  # first slice with the largest ratio; entropy summed in slice order
        later = part_ratio[:, s] > best
        sample = torch.where(later, part_sample[:, s].long(), sample)
        best = torch.maximum(best, part_ratio[:, s])
        entropy = entropy + part_entropy[:, s]
    return argmax, entropy, probs, sample


def _combine_max(part_max: torch.Tensor, part_sum: torch.Tensor, part_idx: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp [N] fp32, first index of the max [N] int64) of whole rows from [N, splits]
    slices, by elementwise ops in slice order (`combine_parts` without its reductions)."""
    top, idx = part_max[:, 0], part_idx[:, 0].long()
    for s in range(1, part_max.shape[1]):
        later = part_max[:, s] > top  # ties keep the earlier slice: the lowest index
        idx = torch.where(later, part_idx[:, s].long(), idx)
        top = torch.maximum(top, part_max[:, s])
    total = part_sum[:, 0] * torch.exp(part_max[:, 0] - top)
    for s in range(1, part_max.shape[1]):
        total = total + part_sum[:, s] * torch.exp(part_max[:, s] - top)
    return (top + torch.log(total)).contiguous(), idx
