"""Diffusion-Gemma's FP8 projections fused into one weight (layers.fuse_linears, model.fuse_projections_):
q/k/v (and gate/up where whole 128-row blocks) as one e4m3 weight with one scale grid give every output
the bits of the separate `Fp8Linear`s; parts that are not whole blocks stay apart.

CPU: the dequantize reference path, and the Triton FP8 GEMM under the interpreter (TRITON_INTERPRET=1,
a subprocess: tests/triton_helpers.py). GPU (`-m gpu`): 26B-A4B attention shapes in bf16.
"""
import importlib.util

import pytest
import torch
from triton_helpers import run_interpreter_checks

from fluxlab.engine.layers.quantization import Fp8Linear

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _fp8(module: torch.nn.Module, names: tuple[str, ...]) -> None:
    for name in names:
        setattr(module, name, Fp8Linear.quantized(getattr(module, name).weight.data))


def check(hidden: int, heads: int, kv_heads: int, head_dim: int, has_v: bool, inter: int, n: int, device) -> None:
    from fluxlab.models.diffusion_gemma.layers import GemmaAttention, GemmaMLP

    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    attn = GemmaAttention(hidden, heads, kv_heads, head_dim, 1e-6, has_v_proj=has_v)
    mlp = GemmaMLP(hidden, inter)
    with torch.no_grad():
        for p in [*attn.parameters(), *mlp.parameters()]:
            p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if p.dim() > 1 else 1.0))
    attn, mlp = attn.to(device=device, dtype=dtype), mlp.to(device=device, dtype=dtype)
    _fp8(attn, ("q_proj", "k_proj", "v_proj") if has_v else ("q_proj", "k_proj"))
    _fp8(mlp, ("gate_proj", "up_proj", "down_proj"))
    x = (torch.randn(n, hidden, generator=gen) * 3).to(device=device, dtype=dtype)
    angles = torch.rand(n, head_dim // 2, generator=gen) * 6
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)
    with torch.no_grad():
        apart = (*attn.qkv(x, cos, sin), mlp(x))
        attn.fuse_projections_()
        mlp.fuse_projections_()
        fused = (*attn.qkv(x, cos, sin), mlp(x))
    assert attn.qkv_weight is not None and attn.qkv_weight.dtype == torch.float8_e4m3fn
    rows = sum(p.weight.shape[0] for p in attn.projections())
    assert attn.qkv_weight.shape == (rows, hidden) and attn.qkv_scale_inv.shape == (rows // 128, -(-hidden // 128))
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()  # the layers' weights are views now
    assert attn.k_proj.weight_scale_inv.data_ptr() == attn.qkv_scale_inv[heads * head_dim // 128:].data_ptr()
    # gate/up fuse only as whole 128-row blocks: a block would otherwise hold rows of both under one scale
    assert (mlp.gate_up_weight is not None) == (inter % 128 == 0), (inter, mlp.gate_up_weight is None)
    for f, a, name in zip(fused, apart, ("q", "k", "v", "dense MLP")):
        assert torch.equal(f, a), f"fused {name} differs"


def _cases(device, n: int) -> None:
    check(hidden=256, heads=2, kv_heads=1, head_dim=128, has_v=True, inter=128, n=n, device=device)
    check(hidden=200, heads=2, kv_heads=1, head_dim=128, has_v=False, inter=96, n=n, device=device)  # k = v, ragged K


def test_fp8_fused_projections_give_the_separate_layers_bits_on_the_cpu_reference():
    _cases("cpu", n=5)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (the check runs it under TRITON_INTERPRET=1)")
def test_fp8_fused_projections_give_the_separate_layers_bits_interpreter():
    run_interpreter_checks(__file__)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU and triton")
def test_fp8_fused_projections_on_26b_shapes():
    check(hidden=2816, heads=16, kv_heads=8, head_dim=256, has_v=True, inter=2112, n=512, device="cuda")
    check(hidden=2816, heads=16, kv_heads=2, head_dim=512, has_v=False, inter=2112, n=256, device="cuda")


if __name__ == "__main__":
    from fluxlab.engine.layers.fp8 import use_fp8_kernel

    assert use_fp8_kernel(torch.zeros(1)), "the interpreter run must take the Triton FP8 GEMM"
    _cases("cpu", n=5)
    print("interpreter checks ok")
