"""The fused Gemma-4 norms of Diffusion-Gemma's bf16 layers (fluxlab/kernels/gemma_norm.py) against
the torch ops they replace (layers.py: GemmaRMSNorm, rotate, the layer's adds and scalar), and a
row's bits alone vs among other rows (batch invariance).

CPU: under the Triton interpreter (TRITON_INTERPRET=1) in a subprocess (tests/triton_helpers.py), in
bf16: every element equal to the torch path's or one bf16 ulp off (the sum of squares is reduced in
another order), on a small fraction of elements. GPU (`-m gpu`): the same checks at 26B-A4B shapes.
"""
import importlib.util

import pytest
import torch
from triton_helpers import run_interpreter_checks

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal, or one ulp of the bf16 grid off, on at most 2% of the elements (a norm alone)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    g, w = got.float(), want.float()
    ulp = torch.where(w == 0, torch.full_like(w, 1e-30), w.abs() * 2.0 ** -7)
    off = (g - w).abs()
    assert bool(torch.isfinite(g).all()), what
    assert bool((off <= ulp * 1.01).all()), (what, off.max().item())
    assert (off > 0).float().mean().item() < 0.02, (what, (off > 0).float().mean().item())


def near(got: torch.Tensor, want: torch.Tensor, what: str, exact: bool) -> None:
    """What follows a norm (an add, a rotation, a matmul): bit for bit under the interpreter; on the
    GPU, where a norm may be one ulp off, as bf16 arithmetic (an add or a rotation that cancels
    turns one ulp of an operand into several of the result)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    if exact:
        assert torch.equal(got, want), what
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert bool(torch.isfinite(got).all()) and err < 5e-3, (what, err.item())


def _torch_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """`GemmaRMSNorm`'s torch ops (its forward takes the kernel on a GPU)."""
    x32 = x.float()
    return (x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + norm.eps, -0.5) * norm.weight.float()).type_as(x)


def _layer(hidden: int, heads: int, kv_heads: int, head_dim: int, sliding: bool, device, dtype, gen):
    from fluxlab.models.diffusion_gemma.layers import GemmaDecoderLayer

    layer = GemmaDecoderLayer(0, hidden, 2 * hidden, heads, kv_heads, head_dim, sliding, num_experts=8, top_k=2,
                              moe_intermediate_size=hidden // 2, eps=1e-6)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0))
        layer.layer_scalar.fill_(0.7)
    return layer.to(device=device, dtype=dtype)


def check(hidden: int, heads: int, kv_heads: int, head_dim: int, sliding: bool, n: int, device, gen) -> None:
    from fluxlab.kernels import gemma_norm
    from fluxlab.models.diffusion_gemma.layers import rotate

    dtype = torch.bfloat16
    layer = _layer(hidden, heads, kv_heads, head_dim, sliding, device, dtype, gen)
    x = (torch.randn(n, hidden, generator=gen) * 3).to(device=device, dtype=dtype)
    a = torch.randn(n, hidden, generator=gen).to(device=device, dtype=dtype)
    o = torch.randn(n, heads, head_dim, generator=gen).to(device=device, dtype=dtype)  # attention's output
    angles = torch.rand(n, head_dim // 2, generator=gen) * 6
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)
    norm = layer.input_layernorm
    torch_path = lambda t: False  # noqa: E731

    with torch.no_grad():
        fused = gemma_norm.use_kernel
        # the plain norm (scaled and unscaled) and the per-head norm + rotation
        got = gemma_norm.norm_rope(x, norm.weight, norm.eps)
        q = torch.randn(n, heads, head_dim, generator=gen).to(device=device, dtype=dtype)
        got_q = gemma_norm.norm_rope(q, layer.self_attn.q_norm.weight, 1e-6, cos, sin)
        got_v = gemma_norm.norm_rope(q, None, 1e-6)
        got_qkv = layer.qkv(x, cos, sin)
        got_ff = layer.feed_forward(x, o, static=True, scalar=layer.layer_scalar)
        gemma_norm.use_kernel = torch_path
        try:
            want = norm(x)
            want_q = rotate(layer.self_attn.q_norm(q), cos, sin)
            want_v = layer.self_attn.v_norm(q)
            want_qkv = layer.qkv(x, cos, sin)
            want_ff = layer.feed_forward(x, o, static=True, scalar=layer.layer_scalar)
        finally:
            gemma_norm.use_kernel = fused
    exact = device == "cpu"
    close(got, want, "norm")
    close(got_v, want_v, "v norm")
    normed = gemma_norm.norm_rope(q, layer.self_attn.q_norm.weight, 1e-6)
    close(normed, layer.self_attn.q_norm(q) if exact else _torch_norm(layer.self_attn.q_norm, q), "q norm")
    assert torch.equal(got_q, rotate(normed, cos, sin))  # the rotation of its own normed values: bit for bit
    near(got_q, want_q, "q norm + rope", exact)
    for g, w, name in zip(got_qkv, want_qkv, "qkv"):
        near(g, w, f"layer {name}", exact)
    # the feed-forward's two fused kernels against the ops they replace
    with torch.no_grad():
        args = (layer.post_attention_layernorm.weight, layer.pre_feedforward_layernorm.weight,
                layer.pre_feedforward_layernorm_2.weight, layer.router.scale, layer.router.root_size, 1e-6)
        w = (layer.post_feedforward_layernorm_1.weight, layer.post_feedforward_layernorm_2.weight,
             layer.post_feedforward_layernorm.weight)
        got_attn = gemma_norm.attn_residual(a, x, *args)
        d = torch.randn(n, hidden, generator=gen).to(device=device, dtype=dtype)
        got_res = gemma_norm.ffn_residual(d, a, x, *w, layer.layer_scalar, 1e-6)
        gemma_norm.use_kernel = torch_path
        try:
            xn = x + layer.post_attention_layernorm(a)
            want_attn = (xn, layer.pre_feedforward_layernorm(xn), layer.pre_feedforward_layernorm_2(xn),
                         layer.router.norm(xn) * layer.router.scale * layer.router.root_size)
            want_res = (x + layer.post_feedforward_layernorm(layer.post_feedforward_layernorm_1(d)
                                                             + layer.post_feedforward_layernorm_2(a))) * layer.layer_scalar
        finally:
            gemma_norm.use_kernel = fused
    for g, w_, name in zip(got_attn, want_attn, ("residual", "pre-FFN", "pre-FFN 2", "router input")):
        near(g, w_, name, exact)
    near(got_res, want_res, "post-FFN residual", exact)
    # the whole feed-forward: routing may pick another expert where a score moved by an ulp
    if exact:
        assert torch.equal(got_ff, want_ff)
    err = (got_ff.float() - want_ff.float()).norm() / want_ff.float().norm()
    assert err < 2e-2, ("feed_forward", err.item())
    # a row's outputs do not depend on how many rows share the call
    with torch.no_grad():
        firsts = [gemma_norm.norm_rope(q[:r], layer.self_attn.k_norm.weight, 1e-6, cos[:r], sin[:r])[:3]
                  for r in (3, n)]
        assert torch.equal(firsts[0], firsts[1])
        firsts = [gemma_norm.attn_residual(a[:r], x[:r], *args) for r in (3, n)]
        assert all(torch.equal(f[:3], g[:3]) for f, g in zip(*firsts))
        firsts = [gemma_norm.ffn_residual(a[:r], q.view(n, -1)[:r, :hidden], x[:r], *w, layer.layer_scalar,
                                          1e-6)[:3] for r in (3, n)]
        assert torch.equal(firsts[0], firsts[1])
        per_token = gemma_norm.ffn_residual(a, x, x, *w, torch.full((n, 1), 0.7, dtype=dtype, device=device), 1e-6)
        assert torch.equal(per_token, gemma_norm.ffn_residual(a, x, x, *w, layer.layer_scalar, 1e-6))
    # q/k/v and gate/up as one weight each (the CUDA bf16 engine's layout, model.fuse_projections_): the same
    # bits, q/k/v normed and rotated where they sit in the fused output (heads of a column slice)
    with torch.no_grad():
        apart = (*layer.qkv(x, cos, sin), layer.mlp(x))
        weights = [p.weight.data_ptr() for p in layer.self_attn.projections()]
        layer.self_attn.fuse_projections_()
        layer.mlp.fuse_projections_()
        assert [p.weight.data_ptr() for p in layer.self_attn.projections()] != weights  # views of the fused weight now
        assert layer.self_attn.q_proj.weight.data_ptr() == layer.self_attn.qkv_weight.data_ptr()
        fused = (*layer.qkv(x, cos, sin), layer.mlp(x))
    for f, a_, name in zip(fused, apart, ("q", "k", "v", "dense MLP")):
        assert torch.equal(f, a_), f"fused {name} differs"


def _interpreter_checks() -> None:
    gen = torch.Generator().manual_seed(0)
    check(hidden=96, heads=4, kv_heads=2, head_dim=32, sliding=True, n=7, device="cpu", gen=gen)
    check(hidden=80, heads=2, kv_heads=1, head_dim=64, sliding=False, n=5, device="cpu", gen=gen)  # k_eq_v, ragged D
    print("interpreter checks ok")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (the CPU check runs it under TRITON_INTERPRET=1)")
def test_gemma_norms_match_torch_interpreter():
    run_interpreter_checks(__file__)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU and triton")
def test_gemma_norms_on_26b_shapes():
    gen = torch.Generator().manual_seed(0)
    check(hidden=2816, heads=16, kv_heads=8, head_dim=256, sliding=True, n=512, device="cuda", gen=gen)
    check(hidden=2816, heads=16, kv_heads=2, head_dim=512, sliding=False, n=256, device="cuda", gen=gen)


if __name__ == "__main__":
    _interpreter_checks()
