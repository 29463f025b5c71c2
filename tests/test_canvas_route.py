"""Diffusion-Gemma's router after its GEMM in one kernel (kernels/route_topk.py, softmax_topk_from_logits)
against the torch ops it replaces on CUDA (layers.GemmaRouter.route), and a token's routing alone vs
among other tokens.

CPU: under the Triton interpreter (TRITON_INTERPRET=1) in a subprocess (tests/triton_helpers.py). GPU
(`-m gpu`): 26B-A4B's router (128 experts, top-8) on bf16 scores at 1 and 16 canvases.
"""
import importlib.util

import pytest
import torch
from triton_helpers import run_interpreter_checks

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def torch_route(scores: torch.Tensor, top_k: int, scale: torch.Tensor):
    """GemmaRouter.route's ops after the GEMM (the CPU path)."""
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    weights, index = torch.topk(probs, k=top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scale[index], index


def check(tokens: int, experts: int, top_k: int, dtype, device, gen, same_experts: float = 1.0) -> None:
    from fluxlab.kernels.route_topk import softmax_topk_from_logits

    scores = (torch.randn(tokens, experts, generator=gen, device=device) * 3).to(dtype)
    scale = (torch.rand(experts, generator=gen, device=device) + 0.5).to(dtype)
    got_w, got_i = softmax_topk_from_logits(scores, top_k, scale)
    want_w, want_i = torch_route(scores, top_k, scale)
    assert got_w.dtype == want_w.dtype == torch.float32 and got_i.dtype == want_i.dtype == torch.int64
    rows = (got_i == want_i).all(dim=-1)
    assert rows.float().mean().item() >= same_experts, (tokens, experts, top_k, rows.float().mean().item())
    torch.testing.assert_close(got_w[rows], want_w[rows], rtol=2e-6, atol=1e-7)
    for first in (1, tokens // 3):  # a token's routing alone = among the others, bit for bit
        alone_w, alone_i = softmax_topk_from_logits(scores[:first], top_k, scale)
        assert torch.equal(alone_i, got_i[:first]) and torch.equal(alone_w, got_w[:first]), (tokens, first)


def _interpreter_checks() -> None:
    from fluxlab.kernels.route_topk import softmax_topk_from_logits

    gen = torch.Generator().manual_seed(0)
    check(40, 128, 8, torch.float32, "cpu", gen)  # the 26B-A4B router's shape
    check(33, 6, 3, torch.bfloat16, "cpu", gen)  # experts and top-k not powers of two
    check(9, 8, 1, torch.float32, "cpu", gen)  # top-1: a weight of one times the scale
    # ties: equal probabilities are taken lowest index first
    w, i = softmax_topk_from_logits(torch.zeros(2, 8), 3, torch.ones(8))
    assert i.tolist() == [[0, 1, 2]] * 2 and torch.allclose(w, torch.full((2, 3), 1 / 3))
    print("interpreter checks ok")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (the CPU check runs it under TRITON_INTERPRET=1)")
def test_softmax_router_kernel_matches_the_torch_ops_interpreter():
    run_interpreter_checks(__file__)


def test_the_router_takes_the_kernel_only_on_cuda_in_half_precision(monkeypatch):
    """CPU and fp32 keep the torch ops (the definition transformers' router is checked against)."""
    import fluxlab.models.diffusion_gemma.layers as layers

    calls = []
    monkeypatch.setattr(layers, "softmax_topk_from_logits", lambda *a: calls.append(a))
    router = layers.GemmaRouter(16, 8, 2, 1e-6)
    torch.nn.init.normal_(router.proj.weight)
    weights, index = router(torch.randn(5, 16))
    assert not calls and weights.shape == index.shape == (5, 2)
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))  # the scales are ones: renormalised weights


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU and triton")
def test_softmax_router_on_26b_shapes_on_gpu():
    import fluxlab.models.diffusion_gemma.layers as layers

    gen = torch.Generator(device="cuda").manual_seed(0)
    # fp32 scores: bf16 ones tie often (8-bit mantissas, 128 experts), and torch.topk orders ties as it likes;
    # the kernel upcasts the engine's bf16 scores to these anyway
    for tokens in (256, 4096):  # one canvas, 16 canvases
        check(tokens, 128, 8, torch.float32, "cuda", gen, same_experts=0.99)
    router = layers.GemmaRouter(2816, 128, 8, 1e-6).to(device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(router.proj.weight, std=0.02)
    x = torch.randn(256, 2816, device="cuda", dtype=torch.bfloat16)
    kernel = layers.softmax_topk_from_logits
    calls = []
    layers.softmax_topk_from_logits = lambda *a: calls.append(1) or kernel(*a)
    try:
        weights, index = router(x)
    finally:
        layers.softmax_topk_from_logits = kernel
    assert calls == [1] and weights.dtype == torch.float32 and index.shape == (256, 8)


if __name__ == "__main__":
    _interpreter_checks()
