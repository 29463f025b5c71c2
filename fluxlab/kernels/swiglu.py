"""Gated activations' elementwise half, act(gate) * up, in one Triton pass with torch's roundings.

torch runs `F.silu(gate) * up` as two kernels (the silu writes a [T, I] tensor the multiply reads
back); on the shared experts and the dense layer that was two launches a layer. Here, per element in
fp32: silu = g / (1 + exp(-g)) with the accurate exp and an IEEE division (torch's opmath), rounded
to the dtype; times up, rounded again: the bits of torch's two kernels on CUDA (tests/test_swiglu.py).
The inputs may be fp32 (the MoE block's one GEMM for the shared expert and the router, whose logits
must stay fp32); they are rounded to the output dtype first, as a bf16 GEMM rounds its output.

`gelu_tanh_mul` is Diffusion-Gemma's dense GeGLU, `F.gelu(gate, approximate="tanh") * up`, the same way:
torch's formula 0.5 * g * (1 + tanh(sqrt(2/pi) * (g + 0.044715 * g^3))) in fp32 with libdevice's tanhf,
rounded, times up, rounded (two kernels and a [T, I] round trip a layer in torch: ~1.6 ms of a 26B-A4B
denoising step at 16 canvases on an H200, 2026-12-04 profile).
"""
from __future__ import annotations

import torch

from fluxlab.kernels.fused_norm import HAVE_TRITON, _INTERPRETED, _rnd, _tl_dtype, tl, triton  # noqa: F401
from fluxlab.kernels.pdl import launch as pdl_launch, start as pdl_start

if HAVE_TRITON:
    from triton.language.extra import libdevice

    @triton.jit
    def _gated_mul_kernel(g_ptr, u_ptr, out_ptr, n_cols, stride_g, stride_u, BLOCK: tl.constexpr,
                          DT: tl.constexpr, GELU: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n_cols
        # fp32 inputs (a GEMM with an fp32 output) are first rounded as a DT GEMM output would be
        g = _rnd(tl.load(g_ptr + row * stride_g + cols, mask=inside, other=0.0).to(tl.float32), DT)
        u = _rnd(tl.load(u_ptr + row * stride_u + cols, mask=inside, other=0.0).to(tl.float32), DT)
        if GELU:  # torch's gelu(approximate="tanh"): kBeta = float(sqrt(2) * 2 / sqrt(pi) * 0.5)
            inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
            if _INTERPRETED:  # (libdevice has no interpreter form) tanh to an ulp or two: no cancellation
                e = tl.exp(-2.0 * tl.abs(inner))
                t = tl.where(inner < 0, -1.0, 1.0) * ((1.0 - e) / (1.0 + e))
            else:
                t = libdevice.tanh(inner)  # tanhf, as torch's kernel
            a = 0.5 * g * (1.0 + t)
        else:
            if _INTERPRETED:
                e = tl.exp(-g)
            else:
                e = libdevice.exp(-g)  # expf, not tl.exp's ex2.approx
            a = tl.math.div_rn(g, 1.0 + e)
        y = _rnd(_rnd(a, DT) * u, DT)
        tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """gate, up [T, I] (rows may be strided, e.g. halves of one [T, 2I] GEMM) -> silu(gate) * up,
    contiguous [T, I] in `dtype` (default theirs). fp32 inputs with a bf16/fp16 dtype are rounded
    to it first: silu_mul(A.float(), B.float(), bf16) is silu_mul(A, B) for bf16 A and B."""
    return _gated_mul(gate, up, dtype, gelu=False)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [T, I] (rows may be strided) -> F.gelu(gate, approximate="tanh") * up, contiguous, their dtype."""
    return _gated_mul(gate, up, None, gelu=True)


def _gated_mul(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype | None, gelu: bool) -> torch.Tensor:
    assert gate.shape == up.shape and gate.dim() == 2 and gate.dtype == up.dtype, (gate.shape, up.shape)
    dtype = dtype or gate.dtype
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    if up.stride(-1) != 1:
        up = up.contiguous()
    T, n = gate.shape
    out = torch.empty(T, n, dtype=dtype, device=gate.device)
    if T and n:
        block = min(1024, triton.next_power_of_2(n))
        _gated_mul_kernel[(T, triton.cdiv(n, block))](gate, up, out, n, gate.stride(0), up.stride(0), BLOCK=block,
                                                       DT=_tl_dtype(dtype), GELU=gelu,
                                                       num_warps=4 if block >= 512 else 1, **pdl_launch())
    return out
