"""Routers after their GEMM, in one Triton launch (sync-free, CUDA-graph capturable).

`route_topk_from_logits(logits, expert_bias, ...)`: the router GEMM stays torch (`moe.router_logits`,
fp32 logits, as `moe.route`); then one program per token does sigmoid, +bias, group scores (sum of
the top-2 biased scores per group), keeps topk_group groups, picks top_k experts among them in
descending order of biased score, and weighs them: unbiased scores / (sum + 1e-20) *
routed_scaling_factor. Ties are broken toward the lowest index (group and expert), which is what
torch.topk does in practice but does not promise. `route_topk(x, ...)` adds the GEMM (the tests).

`softmax_topk_from_logits(logits, top_k, expert_scale)` is Diffusion-Gemma's router (layers.GemmaRouter.route)
in the same program: softmax over the experts in fp32, the top_k probabilities renormalised to sum
to one, each times its expert's learned scale. A token's row is one program, so the result does not
depend on the other tokens (the canvas path's batch invariance); on CUDA it replaces torch's softmax,
topk (two kernels), sum, division, gather and product (~0.7 ms of a 26B-A4B step at one canvas on an
H200, 2026-12-04 profile).

Residual differences against torch on CUDA: tl.sigmoid's and tl.exp's exp are the fast-math
approximation and the sums are reduced in another order, so near-ties may swap and a weight may move
by an ulp (tests/test_fused_norm.py measures it: >= 99% of rows the same experts).

Needs CUDA (or TRITON_INTERPRET=1 on CPU, used by the tests).
"""
from __future__ import annotations

import torch

from fluxlab.kernels.fused_norm import HAVE_TRITON, _next_pow2, tl, triton  # noqa: F401
from fluxlab.kernels.pdl import launch as pdl_launch, start as pdl_start

if HAVE_TRITON:

    @triton.jit
    def _ordered(x):
        """fp32 -> int64 with the same order (not NaN): the bits, negatives' magnitude bits flipped."""
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)

    @triton.jit
    def _unordered(key):
        """The fp32 whose `_ordered` is key >> 32 (the value half of a packed key)."""
        bits = (key >> 32).to(tl.int32)
        return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)

    @triton.jit
    def _route_kernel(logits_ptr, bias_ptr, idx_ptr, w_ptr, stride_l, scale,
                      G: tl.constexpr, GS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GS: tl.constexpr,
                      TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, TOP2: tl.constexpr, SHARED_ID: tl.constexpr, PDL: tl.constexpr = False):
        # Every "largest, lowest index on ties" is one max over packed keys (value << 32 | ~index):
        # separate value-max, index-min and score-sum reductions made three reductions a pick.
        pdl_start(PDL)
        t = tl.program_id(0).to(tl.int64)
        g = tl.arange(0, BLOCK_G)[:, None]
        j = tl.arange(0, BLOCK_GS)[None, :]
        e = g * GS + j                                    # expert id [BLOCK_G, BLOCK_GS]
        valid = (g < G) & (j < GS)
        BIG: tl.constexpr = BLOCK_G * BLOCK_GS
        NONE: tl.constexpr = -9223372036854775807 - 1    # below every packed key
        row = logits_ptr + t * stride_l
        choice = tl.sigmoid(tl.load(row + e, mask=valid, other=0.0))
        if HAS_BIAS:
            choice = choice + tl.load(bias_ptr + e, mask=valid, other=0.0)
        choice = tl.where(valid, choice, float("-inf"))
        key = (_ordered(choice) << 32) | (BIG - 1 - e).to(tl.int64)
        if G > 1:
            # group score = sum of the top-2 biased scores of each group
            k1 = tl.max(key, axis=1)
            gscore = _unordered(k1)
            if TOP2:
                gscore += _unordered(tl.max(tl.where(key == k1[:, None], NONE, key), axis=1))
            gid = tl.arange(0, BLOCK_G)
            gkey = tl.where(gid < G, (_ordered(gscore) << 32) | (BLOCK_G - 1 - gid).to(tl.int64), NONE)
            keep = gid < 0
            for _ in range(TOPK_GROUP):
                best = tl.max(gkey, axis=0)
                keep = keep | (gkey == best)
                gkey = tl.where(gkey == best, NONE, gkey)
            key = tl.where(keep[:, None], key, NONE)
        kk = tl.arange(0, BLOCK_K)
        out_idx = tl.zeros([BLOCK_K], dtype=tl.int64)
        for i in range(TOP_K):
            best = tl.max(tl.max(key, axis=1), axis=0)
            out_idx = tl.where(kk == i, BIG - 1 - (best & 0xFFFFFFFF), out_idx)
            key = tl.where(key == best, NONE, key)
        kmask = kk < TOP_K
        # the unbiased scores of the picks: the same sigmoid of the same logits, so the same values
        out_w = tl.where(kmask, tl.sigmoid(tl.load(row + out_idx, mask=kmask, other=0.0)), 0.0)
        if TOP_K > 1:
            out_w = out_w / (tl.sum(out_w, axis=0) + 1e-20)
        out_w = out_w * scale
        OUT_K: tl.constexpr = TOP_K + (SHARED_ID >= 0)
        tl.store(idx_ptr + t * OUT_K + kk, out_idx.to(idx_ptr.dtype.element_ty), mask=kmask)
        tl.store(w_ptr + t * OUT_K + kk, out_w, mask=kmask)
        if SHARED_ID >= 0:  # the shared expert's slot, weight 1, after the routed ones
            first = kk == 0
            tl.store(idx_ptr + t * OUT_K + TOP_K + kk, (tl.zeros_like(out_idx) + SHARED_ID).to(idx_ptr.dtype.element_ty),
                     mask=first)
            tl.store(w_ptr + t * OUT_K + TOP_K + kk, tl.zeros_like(out_w) + 1.0, mask=first)

    @triton.jit
    def _softmax_route_kernel(logits_ptr, scale_ptr, idx_ptr, w_ptr, stride_l, E,
                              BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                              PDL: tl.constexpr = False):
        # picks by packed keys as `_route_kernel`: the largest probability, the lowest index on ties
        pdl_start(PDL)
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        valid = e < E
        NONE: tl.constexpr = -9223372036854775807 - 1
        logits = tl.load(logits_ptr + t * stride_l + e, mask=valid, other=float("-inf")).to(tl.float32)
        shifted = tl.exp(logits - tl.max(logits, axis=0))
        probs = shifted / tl.sum(shifted, axis=0)
        key = tl.where(valid, (_ordered(probs) << 32) | (BLOCK_E - 1 - e).to(tl.int64), NONE)
        kk = tl.arange(0, BLOCK_K)
        out_idx = tl.zeros([BLOCK_K], dtype=tl.int64)
        out_w = tl.zeros([BLOCK_K], dtype=tl.float32)
        for i in range(TOP_K):
            best = tl.max(key, axis=0)
            out_idx = tl.where(kk == i, BLOCK_E - 1 - (best & 0xFFFFFFFF), out_idx)
            out_w = tl.where(kk == i, _unordered(best), out_w)
            key = tl.where(key == best, NONE, key)
        kmask = kk < TOP_K
        out_w = out_w / tl.sum(out_w, axis=0)
        out_w = out_w * tl.load(scale_ptr + out_idx, mask=kmask, other=0.0).to(tl.float32)
        tl.store(idx_ptr + t * TOP_K + kk, out_idx.to(idx_ptr.dtype.element_ty), mask=kmask)
        tl.store(w_ptr + t * TOP_K + kk, out_w, mask=kmask)


# Warps per token at 256 experts: one keeps every reduction inside a warp (H200, us per call at 2048 /
# 4096 tokens: 1 warp 6.4 / 11.0, 2 7.9 / 13.7, 4 11.6 / 21.2; docs/benchmarks.md §21).
ROUTE_WARPS = 1


def route_topk_from_logits(logits: torch.Tensor, expert_bias: torch.Tensor | None, top_k: int, n_group: int,
                           topk_group: int, routed_scaling_factor: float, idx_dtype=torch.int64,
                           shared_id: int | None = None):
    """The router after its GEMM: logits [T, E] fp32 -> (topk_idx [T, top_k], topk_weight [T, top_k] fp32).
    shared_id: one more column, every token's slot of that (shared) expert with weight 1 (`route_logits`)."""
    T, E = logits.shape
    logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if n_group <= 1:
        n_group, topk_group = 1, 1
    assert E % n_group == 0 and topk_group <= n_group
    gs = E // n_group
    assert top_k <= topk_group * gs
    width = top_k + (shared_id is not None)
    idx = torch.empty(T, width, dtype=idx_dtype, device=logits.device)
    w = torch.empty(T, width, dtype=torch.float32, device=logits.device)
    if T == 0:
        return idx, w
    has_bias = expert_bias is not None
    bias = expert_bias.float().contiguous() if has_bias else logits
    block_g, block_gs = _next_pow2(n_group), _next_pow2(gs)
    _route_kernel[(T,)](logits, bias, idx, w, logits.stride(0), float(routed_scaling_factor),
                        G=n_group, GS=gs, BLOCK_G=block_g, BLOCK_GS=block_gs, TOPK_GROUP=topk_group,
                        TOP_K=top_k, BLOCK_K=_next_pow2(top_k), HAS_BIAS=has_bias, TOP2=gs >= 2,
                        SHARED_ID=-1 if shared_id is None else shared_id, num_warps=ROUTE_WARPS, **pdl_launch())
    return idx, w


def softmax_topk_from_logits(logits: torch.Tensor, top_k: int, expert_scale: torch.Tensor):
    """Diffusion-Gemma's router after its GEMM (module doc): logits [T, E] (any float dtype) ->
    (topk_weight [T, top_k] fp32, topk_idx [T, top_k] int64), as GemmaRouter.route returns them."""
    T, E = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    assert 1 <= top_k <= E and expert_scale.shape == (E,), (top_k, E, expert_scale.shape)
    idx = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    if T == 0:
        return w, idx
    _softmax_route_kernel[(T,)](logits, expert_scale.contiguous(), idx, w, logits.stride(0), E,
                                BLOCK_E=_next_pow2(E), TOP_K=top_k, BLOCK_K=_next_pow2(top_k),
                                num_warps=ROUTE_WARPS, **pdl_launch())
    return w, idx
