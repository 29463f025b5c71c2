"""Block-scaled FP8 GEMM (Triton): x [M, K] (bf16/fp16/fp32) @ dequant(w [N, K] e4m3).T.

The weight is the DeepSeek-V3 / Qwen3-FP8 layout (fluxlab/engine/layers/fp8.py): e4m3 plus fp32
`weight_scale_inv` [ceil(N/128), ceil(K/128)]. The activations are quantized per token and 128-wide
group *inside* the GEMM: each K-step loads a [BLOCK_M, 128] tile of x, takes its row-wise amax,
divides by amax/448 and rounds to e4m3 in registers (`quant_tile`), then one e4m3 x e4m3 tensor-core
dot whose fp32 result is scaled by the row's activation scale and the column's weight scale and added
to the fp32 accumulator (DeepSeek's fp8_gemm, vLLM's w8a8_block_fp8_matmul, with the activation
quantizer folded in). No separate quantize launch and no fp8 activation buffer: under a CUDA graph a
launch per linear would cost more than the tile arithmetic at decode sizes.

Batch invariant and graph capturable: one tile config whatever M is, the reduction of every output
element is the K-blocks in order into one fp32 accumulator (no split-K), and no host reads.

Quantization arithmetic matches `quantize_token_groups` bit for bit: the divisions are IEEE
(`div_rn`; Triton's plain fp32 `/` is an approximation on NVIDIA GPUs) and the cast rounds to nearest
even. Under the interpreter (TRITON_INTERPRET=1, CPU tests) triton's fp32 -> e4m3 cast mis-rounds a
value that rounds up into the next binade (31.82 -> 16, seen with triton 3.9), so there the rounding
is done in fp32 first (`_round_e4m3`) and the cast only sees representable values.
"""
from __future__ import annotations

import torch

from fluxlab.kernels.moe_align import HAVE_TRITON, _interpret, tl, triton  # noqa: F401

GROUP = 128  # the activation group and weight block width along K: BLOCK_K must equal it
BLOCK_M, BLOCK_N, WARPS, STAGES, GROUP_M = 64, 128, 4, 3, 8

if HAVE_TRITON:
    import fluxlab.kernels.fused_norm  # noqa: F401  (patches the interpreter under TRITON_INTERPRET=1)

    @triton.jit
    def _div(a, b, INTERPRET: tl.constexpr):
        if INTERPRET:
            return a / b
        else:
            return tl.math.div_rn(a, b)

    @triton.jit
    def _round_e4m3(v):
        """v fp32 with |v| <= 448 -> v rounded to the nearest e4m3 value (ties to even), still fp32:
        adding and subtracting 1.5 * 2**23 * ulp rounds at the ulp (fp32 adds round to nearest even)."""
        bits = v.to(tl.int32, bitcast=True)
        exp = tl.maximum((bits >> 23) & 0xFF, 121)        # 121: 2**-6, e4m3's smallest normal binade
        magic = (((exp - 3 + 23) << 23) | 0x400000).to(tl.float32, bitcast=True)
        return (v + magic) - magic

    @triton.jit
    def quant_tile(a, INTERPRET: tl.constexpr):
        """a [BM, 128] -> (e4m3 [BM, 128], fp32 scales [BM]): per row, s = max(amax, 1e-10) / 448,
        q = clamp(a / s, -448, 448) rounded to nearest even (the module doc)."""
        a = a.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-10)
        s = _div(amax, 448.0, INTERPRET)
        v = _div(a, s[:, None], INTERPRET)
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        if INTERPRET:
            v = _round_e4m3(v)
        return v.to(tl.float8e4nv), s

    @triton.jit
    def _fp8_gemm_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_wsn, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         EVEN_K: tl.constexpr, INTERPRET: tl.constexpr):
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        group = GROUP_M * num_pid_n   # grouped order: neighbouring programs share weight strips in L2
        first_m = (pid // group) * GROUP_M
        size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % size_m
        pid_n = (pid % group) // size_m
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        col_ok = cols < N
        x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        ws_ptrs = ws_ptr + (cols // BLOCK_K) * stride_wsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < K - kb * BLOCK_K
                a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            a_q, a_s = quant_tile(a, INTERPRET)
            b_s = tl.load(ws_ptrs + kb, mask=col_ok, other=0.0)
            acc += tl.dot(a_q, b) * a_s[:, None] * b_s[None, :]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(weight [N, K], scale_inv [ceil(N/128), ceil(K/128)]).T -> [M, N] in
    out_dtype (default x.dtype); activations quantized per token group in the kernel."""
    if not HAVE_TRITON:
        raise RuntimeError("fp8_matmul needs triton")
    m, k = x.shape
    n, k_w = weight.shape
    assert k == k_w and scale_inv.shape == (-(-n // GROUP), -(-k // GROUP)), (x.shape, weight.shape, scale_inv.shape)
    assert weight.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32, (weight.dtype, scale_inv.dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
    _fp8_gemm_kernel[grid](x, weight, scale_inv, out, m, n, k, x.stride(0), weight.stride(0), scale_inv.stride(0),
                           out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=GROUP, GROUP_M=GROUP_M,
                           EVEN_K=k % GROUP == 0, INTERPRET=_interpret(), num_warps=WARPS, num_stages=STAGES)
    return out
