"""kernels/swiglu.py: silu(gate) * up (and gelu-tanh(gate) * up) in one pass. Under the CPU interpreter it is torch's value
(fp32) and within 2 ulp of CPU torch's bf16/fp16 (whose exp is another implementation); on a GPU
(`-m gpu`) the bits of torch's two CUDA kernels, extremes included, and the dense MLP with it gives
the torch MLP's output."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_fused_norm import _ulp_diff  # noqa: E402
from triton_helpers import run_interpreter_checks  # noqa: E402

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _inputs(T: int, n: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    gu = (torch.randn(T, 2 * n, generator=gen) * 4)
    # the extremes: exp(-g) overflowing to inf (g -> -0.0) and underflowing (g -> g), zeros, huge values
    extremes = torch.tensor([-200.0, -90.0, -88.7, -20.0, -0.0, 0.0, 1e-30, 20.0, 88.7, 90.0, 3e38, -3e38])
    gu[0, :extremes.numel()] = extremes
    gu = gu.to(device, dtype)
    return gu[:, :n], gu[:, n:]  # strided halves, as one [T, 2I] GEMM's output


def _interpreter_checks() -> None:
    from fluxlab.kernels.swiglu import silu_mul

    for T, n in [(1, 16), (5, 96), (3, 1500)]:
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            g, u = _inputs(T, n, dt)
            out, ref = silu_mul(g, u), F.silu(g) * u
            assert out.shape == ref.shape and out.dtype == dt and out.is_contiguous()
            if dt == torch.float32:
                torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-30)
            else:  # an ulp of the silu (CPU torch's exp differs near rounding ties) is up to 2 of the product
                both_nan = out.isnan() & ref.isnan()
                assert torch.equal(out.isnan(), ref.isnan())
                assert _ulp_diff(out[~both_nan], ref[~both_nan]) <= 2, (T, n, dt)
                assert ((out == ref) | both_nan).float().mean() > 0.99
    assert silu_mul(torch.zeros(0, 8), torch.zeros(0, 8)).shape == (0, 8)
    # fp32 inputs rounded to the output dtype first: the bf16 inputs' result
    g, u = _inputs(4, 300, torch.float32)
    gb, ub = g.bfloat16(), u.bfloat16()
    assert torch.equal(silu_mul(g, u, torch.bfloat16), silu_mul(gb, ub))
    # Diffusion-Gemma's GeGLU: gelu(approximate="tanh") * up, same roundings
    from fluxlab.kernels.swiglu import gelu_tanh_mul

    for T, n in [(1, 16), (5, 96), (3, 1500)]:
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            g, u = _inputs(T, n, dt, seed=T)
            out, ref = gelu_tanh_mul(g, u), F.gelu(g, approximate="tanh") * u
            assert out.shape == ref.shape and out.dtype == dt and out.is_contiguous()
            _gelu_close(out, ref, g, u, (T, n, dt))
    print("interpreter checks ok")


def _gelu_close(out, ref, g, u, where) -> None:
    """Two roundings of the output, plus what an ulp of tanh does to 1 + tanh(inner) near -1 (for
    gate < -4 that sum keeps a few bits: the interpreter's tanh is not CPU torch's tanhf)."""
    nan = out.isnan() & ref.isnan()
    assert torch.equal(out.isnan(), ref.isnan()), where
    o, r = out[~nan].double(), ref[~nan].double()
    inf = o.isinf() | r.isinf()
    assert torch.equal(o[inf], r[inf]), where
    info = torch.finfo(out.dtype)
    bound = 2 * info.eps * r.abs() + 2.0 ** -21 * (g.double() * u.double())[~nan].abs() + info.tiny
    assert ((o - r).abs() <= bound)[~inf].all(), (where, ((o - r).abs() / bound)[~inf].max().item())


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_silu_mul_under_the_triton_interpreter():
    run_interpreter_checks(__file__)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_gives_torchs_bits_on_gpu(dtype):
    from fluxlab.kernels.swiglu import silu_mul

    for T, n in [(1, 512), (2048, 512), (37, 5120)]:
        g, u = _inputs(T, n, dtype, "cuda", seed=T)
        out, ref = silu_mul(g, u), F.silu(g) * u
        same = (out == ref) | (out.isnan() & ref.isnan())  # fp16: 3e38 overflows to inf, and inf * 0 is NaN
        assert same.all(), (T, n, (~same).sum().item())


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gelu_tanh_mul_is_torchs_within_an_ulp_on_gpu(dtype):
    """torch's formula with libdevice's tanhf: an ulp at most (nvcc and Triton may contract other
    multiply-adds into FMAs), and the same bits almost everywhere."""
    from fluxlab.kernels.swiglu import gelu_tanh_mul

    for T, n in [(1, 2112), (4096, 2112), (37, 5120)]:
        g, u = _inputs(T, n, dtype, "cuda", seed=T)
        out, ref = gelu_tanh_mul(g, u), F.gelu(g, approximate="tanh") * u
        both_nan = out.isnan() & ref.isnan()
        assert torch.equal(out.isnan(), ref.isnan()), (T, n)
        assert _ulp_diff(out[~both_nan], ref[~both_nan]) <= 1, (T, n)
        assert ((out == ref) | both_nan).float().mean() > 0.99, (T, n)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
def test_the_mlp_with_silu_mul_gives_the_torch_mlps_output():
    from unittest import mock

    from fluxlab.models.llada2 import model as llada2_moe

    torch.manual_seed(0)
    mlp = llada2_moe.LLaDA2MoeMLP(256, 512, torch.bfloat16, "cuda")
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=256 ** -0.5)
    x = torch.randn(64, 256, device="cuda").bfloat16()
    fused = mlp(x, residual=x)
    with mock.patch.object(llada2_moe, "use_fused", lambda t: False):
        assert torch.equal(fused, mlp(x, residual=x))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
def test_diffusion_gemmas_dense_mlp_takes_the_gelu_kernel_and_stays_torchs_within_an_ulp():
    from unittest import mock

    from fluxlab.models.diffusion_gemma import layers

    torch.manual_seed(0)
    mlp = layers.GemmaMLP(2816, 2112).to(device="cuda", dtype=torch.bfloat16)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=2816 ** -0.5)
    mlp.fuse_projections_()
    x = torch.randn(256, 2816, device="cuda").bfloat16()
    calls = []
    kernel = layers.gelu_tanh_mul
    with mock.patch.object(layers, "gelu_tanh_mul", lambda g, u: calls.append(1) or kernel(g, u)):
        fused = mlp(x)
    with mock.patch.object(layers, "_fused_ok", lambda t: False):
        plain = mlp(x)
    assert calls == [1]
    rel = (fused.float() - plain.float()).norm() / plain.float().norm()
    assert rel < 1e-2, rel.item()  # an ulp of the product can move a bf16 down-projection input


if __name__ == "__main__":
    _interpreter_checks()
