"""Gemma-4 RMSNorms fused with what surrounds them in a Diffusion-Gemma layer (Triton, CUDA bf16).

A 26B-A4B layer runs 11 RMSNorms (input, q/k/v, post-attention, the two pre-FFN ones, the router's,
the two post-FFN ones and the one over their sum). Written as transformers writes them
(`GemmaRMSNorm`: x.float(), pow 2, mean, + eps, pow -0.5, two fp32 products, a cast) each is ~8
launches over fp32 copies; on one H200 they were ~7 of 36 ms a denoising step at batch 1 and
~55 of 191 ms at batch 16 (docs/benchmarks/2026-12-03_h200_diffusion_gemma_profile.txt). Here:

* `norm(x, w, eps)`: one row per program, any row length; w None: no scale (the v norm).
* `norm_rope(x [n, H, D], w, eps, cos, sin)`: the per-head q/k norm, then the rotation
  x * cos + cat(-x2, x1) * sin of `layers.rotate`, cos/sin [n, D] in x's dtype.
* `attn_residual(a, x, ...)`: after attention: x' = x + post_attention_norm(a), then the three
  inputs that read x' (pre-FFN norm, second pre-FFN norm, the router's scaled norm): one pass.
* `ffn_residual(d, r, x, ...)`: (x + post_ffn_norm(post_ffn_norm_1(d) + post_ffn_norm_2(r))) * scalar.

Numerics are transformers' op for op in fp32 (h * rsqrt(mean(h^2) + eps), then * w.float(), one
rounding; bf16 adds and products rounded once each, `fused_norm._rnd`), so values agree with the
torch path to the last bit except where the sum of squares, reduced here in another order, or
the approximate rsqrt moves a result by one ulp. Batch invariance: a row is reduced by the same
code wherever it sits, one row a program (heads: a fixed number of rows a program, by head size
alone), so a token's outputs do not depend on how many share the call.
CUDA half precision only (or TRITON_INTERPRET=1, the tests); fp32 and CPU keep the torch ops.
"""
from __future__ import annotations

import torch

from fluxlab.kernels.fused_norm import HAVE_TRITON, _interpret, _next_pow2, _rnd, _tl_dtype, tl, triton
from fluxlab.kernels.pdl import launch as pdl_launch, start as pdl_start

if HAVE_TRITON:
    @triton.jit
    def _scaled(h, inv, w_ptr, offs, mask, HAS_W: tl.constexpr):
        """h * inv (* w.float()), fp32, transformers' order."""
        y = h * inv
        if HAS_W:
            y = y * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        return y

    @triton.jit
    def _inv_rms(h, D, eps):
        return tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)

    @triton.jit
    def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, heads, x_heads, stride_xt, stride_xh,
                          stride_o, stride_cs, eps, D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                          ROWS: tl.constexpr, HAS_W: tl.constexpr, HAS_ROPE: tl.constexpr, DT: tl.constexpr,
                          PDL: tl.constexpr = False):
        # rows r of x (token r // heads); row r sits at (r // x_heads) * stride_xt + (r % x_heads) * stride_xh
        # (a head of a column slice of a fused projection, or a row of a contiguous [n_rows, D]). Each row
        # loaded as its two halves, so the rotation pairs tiles; the sum of squares is half 1 then half 2,
        # the same for every row.
        pdl_start(PDL)
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
        i = tl.arange(0, BLOCK)[None, :]
        ok = (rows < n_rows) & (i < HALF)
        rows64 = rows.to(tl.int64)
        x_row = x_ptr + (rows64 // x_heads) * stride_xt + (rows64 % x_heads) * stride_xh
        x1 = tl.load(x_row + i, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + HALF + i, mask=ok, other=0.0).to(tl.float32)
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
        y1 = _rnd(_scaled(x1, inv, w_ptr, i, i < HALF, HAS_W), DT)
        y2 = _rnd(_scaled(x2, inv, w_ptr, HALF + i, i < HALF, HAS_W), DT)
        if HAS_ROPE:  # x * cos + cat(-x2, x1) * sin, each product and the sum rounded (torch's bf16 ops)
            cs = (rows64 // heads) * stride_cs
            c1 = tl.load(cos_ptr + cs + i, mask=ok, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + cs + HALF + i, mask=ok, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + cs + i, mask=ok, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + cs + HALF + i, mask=ok, other=0.0).to(tl.float32)
            z1 = _rnd(_rnd(y1 * c1, DT) + _rnd(-y2 * s1, DT), DT)
            z2 = _rnd(_rnd(y2 * c2, DT) + _rnd(y1 * s2, DT), DT)
            y1, y2 = z1, z2
        odt = out_ptr.dtype.element_ty
        tl.store(out_ptr + rows64 * stride_o + i, y1.to(odt), mask=ok)
        tl.store(out_ptr + rows64 * stride_o + HALF + i, y2.to(odt), mask=ok)

    @triton.jit
    def _attn_residual_kernel(a_ptr, x_ptr, w_post_ptr, w_pre_ptr, w_pre2_ptr, scale_ptr, x_out_ptr, pre_ptr,
                              pre2_ptr, router_ptr, D, stride, eps, root, BLOCK: tl.constexpr, DT: tl.constexpr,
                              PDL: tl.constexpr = False):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        a = tl.load(a_ptr + row * stride + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * stride + offs, mask=mask, other=0.0).to(tl.float32)
        x = _rnd(x + _rnd(_scaled(a, _inv_rms(a, D, eps), w_post_ptr, offs, mask, True), DT), DT)
        odt = x_out_ptr.dtype.element_ty
        tl.store(x_out_ptr + row * stride + offs, x.to(odt), mask=mask)
        h = x * _inv_rms(x, D, eps)  # x32 * pow(mean + eps, -0.5): shared by the three norms of x'
        w = tl.load(w_pre_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(pre_ptr + row * stride + offs, _rnd(h * w, DT).to(odt), mask=mask)
        w = tl.load(w_pre2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(pre2_ptr + row * stride + offs, _rnd(h * w, DT).to(odt), mask=mask)
        # the router's input: norm (no scale), * scale, * hidden ** -0.5, each a bf16 op
        s = tl.load(scale_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(router_ptr + row * stride + offs, _rnd(_rnd(_rnd(h, DT) * s, DT) * root, DT).to(odt), mask=mask)

    @triton.jit
    def _ffn_residual_kernel(d_ptr, r_ptr, x_ptr, w1_ptr, w2_ptr, w_ptr, scalar_ptr, out_ptr, D, stride,
                             stride_scalar, eps, BLOCK: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        d = tl.load(d_ptr + row * stride + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * stride + offs, mask=mask, other=0.0).to(tl.float32)
        d = _rnd(_scaled(d, _inv_rms(d, D, eps), w1_ptr, offs, mask, True), DT)
        r = _rnd(_scaled(r, _inv_rms(r, D, eps), w2_ptr, offs, mask, True), DT)
        s = _rnd(d + r, DT)
        s = _rnd(_scaled(s, _inv_rms(s, D, eps), w_ptr, offs, mask, True), DT)
        x = tl.load(x_ptr + row * stride + offs, mask=mask, other=0.0).to(tl.float32)
        scalar = tl.load(scalar_ptr + row * stride_scalar).to(tl.float32)
        out = _rnd(_rnd(x + s, DT) * scalar, DT)  # (the interpreter's bf16 cast truncates)
        tl.store(out_ptr + row * stride + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def use_kernel(x: torch.Tensor) -> bool:
    """CUDA half precision (the serving path); the interpreter runs it on CPU for the tests."""
    return HAVE_TRITON and x.dtype in (torch.bfloat16, torch.float16) and (x.is_cuda or _interpret())


def _warps(block: int) -> int:
    return 1 if block <= 128 else (4 if block <= 1024 else 8)


def _rows_of(x: torch.Tensor, D: int) -> torch.Tensor:
    x2 = x.reshape(-1, D)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor | None = None,
              sin: torch.Tensor | None = None) -> torch.Tensor:
    """`GemmaRMSNorm` over x's last dim (weight None: unscaled), then, with cos/sin [tokens, D] (x
    [tokens, heads, D]), `layers.rotate`. A new contiguous tensor of x's shape and dtype."""
    D = x.shape[-1]
    assert D % 2 == 0 and (weight is None or weight.dtype == x.dtype)
    if x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == D:  # heads of a column slice: read in place
        x2, x_heads, stride_xt, stride_xh = x, x.shape[1], x.stride(0), D
        n = x.shape[0] * x.shape[1]
    else:
        x2 = _rows_of(x, D)
        x_heads, stride_xt, stride_xh, n = 1, x2.stride(0), 0, x2.shape[0]
    out = torch.empty(n, D, dtype=x.dtype, device=x.device)
    rope = cos is not None
    heads = x.shape[-2] if rope else 1
    if rope:
        assert cos.shape == sin.shape == (x.shape[0], D) and cos.dtype == sin.dtype == x.dtype
        cos, sin = cos.contiguous(), sin.contiguous()
    if n:
        block = _next_pow2(D // 2)
        rows = max(1, min(16, 2048 // block))  # by D alone (batch invariance): 8 heads of 256 a program
        _norm_rope_kernel[(triton.cdiv(n, rows),)](
            x2, weight if weight is not None else x2, cos if rope else x2, sin if rope else x2, out, n, heads,
            x_heads, stride_xt, stride_xh, out.stride(0), cos.stride(0) if rope else 0, float(eps), D=D,
            HALF=D // 2, BLOCK=block, ROWS=rows, HAS_W=weight is not None, HAS_ROPE=rope, DT=_tl_dtype(x.dtype),
            num_warps=_warps(block * rows), **pdl_launch())
    return out.view(x.shape)


def attn_residual(a: torch.Tensor, x: torch.Tensor, w_post: torch.Tensor, w_pre: torch.Tensor, w_pre2: torch.Tensor,
                  router_scale: torch.Tensor, router_root: float, eps: float):
    """(x', pre, pre2, router_in) for x' = x + norm(a) * w_post: norm(x') * w_pre, norm(x') * w_pre2
    and norm(x') * router_scale * router_root (a, x [n, D] contiguous)."""
    n, D = x.shape
    a, x = a.contiguous(), x.contiguous()
    assert a.shape == x.shape and a.dtype == x.dtype == w_post.dtype == w_pre.dtype == w_pre2.dtype
    outs = [torch.empty_like(x) for _ in range(4)]
    if n:
        block = _next_pow2(D)
        _attn_residual_kernel[(n,)](a, x, w_post, w_pre, w_pre2, router_scale, *outs, D, x.stride(0), float(eps),
                                    float(torch.tensor(router_root, dtype=torch.float32)), BLOCK=block,
                                    DT=_tl_dtype(x.dtype), num_warps=_warps(block), **pdl_launch())
    return tuple(outs)


def ffn_residual(dense: torch.Tensor, routed: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 w: torch.Tensor, scalar: torch.Tensor, eps: float) -> torch.Tensor:
    """(x + norm(norm(dense) * w1 + norm(routed) * w2) * w) * scalar, scalar [1] or [n, 1] (a per-token
    layer scalar), every add and product a rounded op of x's dtype."""
    n, D = x.shape
    dense, routed, x = dense.contiguous(), routed.contiguous(), x.contiguous()
    assert dense.shape == routed.shape == x.shape and dense.dtype == routed.dtype == x.dtype == w.dtype
    s = scalar.reshape(-1)
    assert s.numel() in (1, n) and s.dtype == x.dtype, (scalar.shape, scalar.dtype)
    out = torch.empty_like(x)
    if n:
        block = _next_pow2(D)
        _ffn_residual_kernel[(n,)](dense, routed, x, w1, w2, w, s, out, D, x.stride(0), 0 if s.numel() == 1 else 1,
                                   float(eps), BLOCK=block, DT=_tl_dtype(x.dtype), num_warps=_warps(block),
                                   **pdl_launch())
    return out
