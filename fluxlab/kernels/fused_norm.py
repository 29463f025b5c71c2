"""Fused RMSNorm and QK-norm + partial RoPE (Triton); the router top-k is kernels/route_topk.py.

A decode step of LLaDA2.0-mini spent ~1/3 of its time in tiny elementwise kernels: RMSNorm is ~7
launches per call (x4 per layer), partial RoPE ~10 each for q and k. These kernels do each of those
in one launch, sync-free (CUDA-graph capturable), with the published numerics:

* `rms_norm(x, w, eps)`: h = x.float(); h = h * rsqrt(mean(h^2) + eps); out = w * h.to(x.dtype)
  (the weight product is fp32(h_bf16) * fp32(w) rounded once to x.dtype, which is what torch's
  bf16 * bf16 multiply does). `add_rms_norm(x, residual, w, eps)` first forms
  new_residual = (x + residual) rounded to x.dtype (torch's bf16 add), then normalises it.
* `qk_norm_rope(qkv, positions, q_w, k_w, eps, cos, sin, Hq, Hkv, D, rd)`: one launch, a program per
  token over the head rows of q, k and v: per-head RMSNorm (as above) of q and k, then rotate-half RoPE
  on the first rd dims, evaluated with torch's bf16 roundings: cos/sin cast to x.dtype,
  x*cos -> x.dtype, rotate_half(x)*sin -> x.dtype, their sum -> x.dtype; dims >= rd pass through.
  v is copied. Returns contiguous q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D];
  `qk_norm_rope_to_cache` writes k and v to their KV-cache slot rows instead and returns q.

Residual differences against torch on CUDA (not bit-exact by construction): the fp32 sum of squares
is reduced in a different order, and tl.rsqrt is the fast-math approximation; either can move a
bf16 result by one ulp in rare rows. The GPU tests
in tests/test_fused_norm.py measure this (bf16 ≤ 1 ulp).

Everything here needs CUDA (or TRITON_INTERPRET=1 on CPU, used by the tests); fp32 callers should
keep the torch path.
"""
from __future__ import annotations

import os

import torch
from fluxlab.kernels.pdl import launch as pdl_launch, start as pdl_start

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except Exception:  # pragma: no cover - triton absent
    triton = None
    tl = None
    HAVE_TRITON = False


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


if HAVE_TRITON and _interpret():
    from fluxlab.kernels.moe_align import _patch_interpreter_for_numpy2

    _patch_interpreter_for_numpy2()


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


if HAVE_TRITON:
    _INTERPRETED = tl.constexpr(_interpret())

    @triton.jit
    def _rnd(x, DT: tl.constexpr):
        """fp32 x rounded to DT (round-to-nearest-even), returned as fp32. On the GPU one cvt.rn in
        inline PTX: a Triton cast pair `x.to(bf16).to(fp32)` did not keep the rounding (the GPU
        tests saw ~10% of QK-norm outputs off torch's), and the bit arithmetic below costs ~10
        integer instructions a rounding, which made QK-norm + RoPE ALU-bound. Under the CPU
        interpreter (no PTX; its bf16 cast truncates) the bit arithmetic, which gives the same
        result (NaN passes through)."""
        if DT == tl.float32:
            return x
        elif _INTERPRETED:
            if DT == tl.bfloat16:
                bits = x.to(tl.uint32, bitcast=True)
                bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
                return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
            return x.to(DT).to(tl.float32)
        elif DT == tl.bfloat16:  # the bf16 bits as the high half of an fp32 word
            return tl.inline_asm_elementwise(
                "{ .reg .b16 t, z; cvt.rn.bf16.f32 t, $1; mov.b16 z, 0; mov.b32 $0, {z, t}; }",
                "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("{ .reg .b16 t; cvt.rn.f16.f32 t, $1; cvt.f32.f16 $0, t; }",
                                             "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)

    # ------------------------------------------------------------------------------------------
    # RMSNorm (optionally with the residual add in front)
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_rows, D, stride_x, stride_r,
                         stride_o, stride_ro, eps, HAS_RES: tl.constexpr, BLOCK_D: tl.constexpr,
                         ROWS: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK_D)
        dmask = offs < D
        w = tl.load(w_ptr + offs, mask=dmask, other=0.0).to(tl.float32)
        for r in range(ROWS):
            row = pid * ROWS + r
            if row < n_rows:
                row64 = row.to(tl.int64)
                x = tl.load(x_ptr + row64 * stride_x + offs, mask=dmask, other=0.0)
                if HAS_RES:
                    res = tl.load(res_ptr + row64 * stride_r + offs, mask=dmask, other=0.0)
                    # torch's x + residual in x.dtype: fp32 sum rounded once
                    x = _rnd(x.to(tl.float32) + res.to(tl.float32), DT).to(res_out_ptr.dtype.element_ty)
                    tl.store(res_out_ptr + row64 * stride_ro + offs, x, mask=dmask)
                h = x.to(tl.float32)
                ms = tl.sum(h * h, axis=0) / D
                h = h * tl.rsqrt(ms + eps)
                y = _rnd(_rnd(h, DT) * w, DT)
                tl.store(out_ptr + row64 * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=dmask)

    # ------------------------------------------------------------------------------------------
    # QK-norm + partial RoPE (+ v copy)
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _qk_norm_rope_kernel(qkv_ptr, pos_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slot_ptr,
                             stride_t, stride_cs, eps, HQ: tl.constexpr, HKV: tl.constexpr,
                             D: tl.constexpr, RD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_P: tl.constexpr, HAS_NORM: tl.constexpr, HAS_POS: tl.constexpr,
                             HAS_SLOTS: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr = False):
        # One program per token, its heads the rows of [BLOCK_H, .] tiles: a program per (token, head)
        # moved 256 bytes and left the kernel launch-bound. Each row is loaded as its two rotary
        # halves and the pass-through rest, so rotate_half pairs tiles instead of gathering.
        pdl_start(PDL)
        HALF: tl.constexpr = RD // 2
        REST: tl.constexpr = D - RD
        t = tl.program_id(0).to(tl.int64)
        head = tl.arange(0, BLOCK_H)[:, None]
        i = tl.arange(0, BLOCK_R)[None, :]
        j = tl.arange(0, BLOCK_P)[None, :]
        rows = head < HQ + 2 * HKV
        in_half = rows & (i < HALF)
        in_rest = rows & (j < REST)
        is_q = head < HQ
        is_v = head >= HQ + HKV
        src = qkv_ptr + t * stride_t + head * D
        raw1 = tl.load(src + i, mask=in_half, other=0.0)
        raw2 = tl.load(src + HALF + i, mask=in_half, other=0.0)
        raw3 = tl.load(src + RD + j, mask=in_rest, other=0.0)
        x1, x2, x3 = raw1.to(tl.float32), raw2.to(tl.float32), raw3.to(tl.float32)
        if HAS_NORM:
            r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(x3 * x3, axis=1)) / D + eps)
            r = r[:, None]
            w1 = tl.where(is_q, tl.load(qw_ptr + i, mask=i < HALF, other=0.0),
                          tl.load(kw_ptr + i, mask=i < HALF, other=0.0)).to(tl.float32)
            w2 = tl.where(is_q, tl.load(qw_ptr + HALF + i, mask=i < HALF, other=0.0),
                          tl.load(kw_ptr + HALF + i, mask=i < HALF, other=0.0)).to(tl.float32)
            w3 = tl.where(is_q, tl.load(qw_ptr + RD + j, mask=j < REST, other=0.0),
                          tl.load(kw_ptr + RD + j, mask=j < REST, other=0.0)).to(tl.float32)
            x1 = _rnd(_rnd(x1 * r, DT) * w1, DT)
            x2 = _rnd(_rnd(x2 * r, DT) * w2, DT)
            x3 = _rnd(_rnd(x3 * r, DT) * w3, DT)
        if HAS_POS:
            prow = tl.load(pos_ptr + t).to(tl.int64)
        else:
            prow = t
        # cos_cache[positions].to(dtype) as published
        cs = prow * stride_cs
        c1 = _rnd(tl.load(cos_ptr + cs + i, mask=i < HALF, other=1.0).to(tl.float32), DT)
        c2 = _rnd(tl.load(cos_ptr + cs + HALF + i, mask=i < HALF, other=1.0).to(tl.float32), DT)
        s1 = _rnd(tl.load(sin_ptr + cs + i, mask=i < HALF, other=0.0).to(tl.float32), DT)
        s2 = _rnd(tl.load(sin_ptr + cs + HALF + i, mask=i < HALF, other=0.0).to(tl.float32), DT)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), each product and the sum rounded
        odt = q_ptr.dtype.element_ty
        y1 = _rnd(_rnd(x1 * c1, DT) + _rnd(-x2 * s1, DT), DT).to(odt)
        y2 = _rnd(_rnd(x2 * c2, DT) + _rnd(x1 * s2, DT), DT).to(odt)
        y3 = x3.to(odt)
        qk = ~is_v
        if HAS_SLOTS:  # k/v rows are cache slot rows: token t's go to row slot[t]
            kv_row = tl.load(slot_ptr + t).to(tl.int64)
        else:
            kv_row = t
        dst = tl.where(is_q, q_ptr + (t * HQ + head) * D, k_ptr + (kv_row * HKV + head - HQ) * D)
        tl.store(dst + i, y1, mask=in_half & qk)
        tl.store(dst + HALF + i, y2, mask=in_half & qk)
        tl.store(dst + RD + j, y3, mask=in_rest & qk)
        vdst = v_ptr + (kv_row * HKV + head - HQ - HKV) * D  # v: a plain copy
        tl.store(vdst + i, raw1, mask=in_half & is_v)
        tl.store(vdst + HALF + i, raw2, mask=in_half & is_v)
        tl.store(vdst + RD + j, raw3, mask=in_rest & is_v)


# ----------------------------------------------------------------------------------------------
# Python wrappers
# ----------------------------------------------------------------------------------------------

def _norm_launch_params(n_rows: int, D: int):
    block = _next_pow2(D)
    warps = 1 if block <= 256 else (4 if block <= 2048 else 8)
    rows = 1 if n_rows <= 4096 or _interpret() else 4
    return block, warps, rows


def _tl_dtype(dt: torch.dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dt]


def _check_rows(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype), shape and dtype of x."""
    assert weight.dtype == x.dtype, "weight must have x's dtype (torch would promote otherwise)"
    shape = x.shape
    D = shape[-1]
    x2 = _check_rows(x.reshape(-1, D))
    n = x2.shape[0]
    out = torch.empty(n, D, dtype=x.dtype, device=x.device)
    if n:
        block, warps, rows = _norm_launch_params(n, D)
        _rms_norm_kernel[(triton.cdiv(n, rows),)](x2, x2, weight, out, out, n, D, x2.stride(0), 0,
                                                  out.stride(0), 0, float(eps), HAS_RES=False,
                                                  BLOCK_D=block, ROWS=rows, DT=_tl_dtype(x.dtype), num_warps=warps,
                                                  **pdl_launch())
    return out.view(shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual), the sum rounded to x.dtype as torch's add does."""
    assert x.shape == residual.shape and x.dtype == residual.dtype == weight.dtype
    shape = x.shape
    D = shape[-1]
    x2 = _check_rows(x.reshape(-1, D))
    r2 = _check_rows(residual.reshape(-1, D))
    n = x2.shape[0]
    out = torch.empty(n, D, dtype=x.dtype, device=x.device)
    new_res = torch.empty(n, D, dtype=x.dtype, device=x.device)
    if n:
        block, warps, rows = _norm_launch_params(n, D)
        _rms_norm_kernel[(triton.cdiv(n, rows),)](x2, r2, weight, out, new_res, n, D, x2.stride(0), r2.stride(0),
                                                  out.stride(0), new_res.stride(0), float(eps), HAS_RES=True,
                                                  BLOCK_D=block, ROWS=rows, DT=_tl_dtype(x.dtype), num_warps=warps,
                                                  **pdl_launch())
    return out.view(shape), new_res.view(shape)


# Warps per token at LLaDA2's 24 heads of 128. H200, us per call at 2048 / 4096 tokens (§21): 2 warps
# 12.9 / 31.8, 4 13.8 / 31.6, 8 15.3 / 29.6: no size wins both, so 4 stays.
QK_WARPS = 4


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor | None, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                 num_q_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int):
    """qkv [T, (Hq+2Hkv)*D] (or [T, Hq+2Hkv, D]; heads and dims contiguous within a token row)
    -> contiguous q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D].

    cos/sin: with `positions` [T] (int), the fp32 caches [P, rotary_dim] indexed by position; with
    positions=None, per-token tables [T, rotary_dim] (any float dtype, row stride allowed), e.g.
    the model's already-cast `cos_sin` (cos[:, 0, :]). Either way they are rounded to qkv.dtype
    before use, as the published code does. q_weight/k_weight None: no QK-norm (use_qk_norm=False).
    """
    T, dev, dt = qkv.shape[0], qkv.device, qkv.dtype
    k = torch.empty(T, num_kv_heads, head_dim, dtype=dt, device=dev)
    v = torch.empty(T, num_kv_heads, head_dim, dtype=dt, device=dev)
    q = _qk_norm_rope(qkv, positions, q_weight, k_weight, eps, cos_cache, sin_cache, num_q_heads, num_kv_heads,
                      head_dim, rotary_dim, k, v, None)
    return q, k, v


def qk_norm_rope_to_cache(qkv: torch.Tensor, positions: torch.Tensor | None, q_weight: torch.Tensor | None,
                          k_weight: torch.Tensor | None, eps: float, cos_cache: torch.Tensor,
                          sin_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
                          rotary_dim: int, k_rows: torch.Tensor, v_rows: torch.Tensor,
                          slot_mapping: torch.Tensor) -> torch.Tensor:
    """`qk_norm_rope` whose k and v go straight to the KV cache: token t's to row slot_mapping[t] of
    k_rows / v_rows ([slots, Hkv, D], contiguous, qkv's dtype), as `KVCache.write` would put them
    (a slot written twice in one call keeps one of the writes, as index_put does). Returns q."""
    assert k_rows.dtype == v_rows.dtype == qkv.dtype and k_rows.is_contiguous() and v_rows.is_contiguous()
    assert k_rows.shape[1:] == v_rows.shape[1:] == (num_kv_heads, head_dim), (k_rows.shape, v_rows.shape)
    assert slot_mapping.shape == (qkv.shape[0],) and not slot_mapping.is_floating_point()
    return _qk_norm_rope(qkv, positions, q_weight, k_weight, eps, cos_cache, sin_cache, num_q_heads, num_kv_heads,
                         head_dim, rotary_dim, k_rows, v_rows, slot_mapping)


def _qk_norm_rope(qkv, positions, q_weight, k_weight, eps, cos_cache, sin_cache, num_q_heads, num_kv_heads,
                  head_dim, rotary_dim, k_out, v_out, slots):
    T = qkv.shape[0]
    H = num_q_heads + 2 * num_kv_heads
    qkv2 = qkv.reshape(T, H * head_dim)
    if qkv2.stride(-1) != 1:
        qkv2 = qkv2.contiguous()
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim
    assert cos_cache.shape[-1] == rotary_dim and sin_cache.shape[-1] == rotary_dim
    cos2 = cos_cache.reshape(-1, rotary_dim)
    sin2 = sin_cache.reshape(-1, rotary_dim)
    if cos2.stride(-1) != 1 or sin2.stride(-1) != 1 or cos2.stride(0) != sin2.stride(0):
        cos2, sin2 = cos2.contiguous(), sin2.contiguous()
    dev, dt = qkv.device, qkv.dtype
    q = torch.empty(T, num_q_heads, head_dim, dtype=dt, device=dev)
    if T == 0:
        return q
    has_norm = q_weight is not None
    assert has_norm == (k_weight is not None)
    assert not has_norm or (q_weight.dtype == dt and k_weight.dtype == dt)
    has_pos = positions is not None
    block_h = _next_pow2(H)
    _qk_norm_rope_kernel[(T,)](
        qkv2, positions if has_pos else qkv2, q_weight if has_norm else qkv2, k_weight if has_norm else qkv2,
        cos2, sin2, q, k_out, v_out, slots if slots is not None else qkv2, qkv2.stride(0), cos2.stride(0),
        float(eps), HQ=num_q_heads, HKV=num_kv_heads, D=head_dim, RD=rotary_dim, BLOCK_H=block_h,
        BLOCK_R=_next_pow2(max(1, rotary_dim // 2)), BLOCK_P=_next_pow2(max(1, head_dim - rotary_dim)),
        HAS_NORM=has_norm, HAS_POS=has_pos, HAS_SLOTS=slots is not None, DT=_tl_dtype(dt),
        num_warps=QK_WARPS if block_h * head_dim >= 2048 else 1, **pdl_launch())
    return q
