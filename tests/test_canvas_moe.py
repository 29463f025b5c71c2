"""Diffusion-Gemma's routed experts through the fused Triton MoE (gelu-tanh) against the
transformers-order loop of GemmaExperts, and batch invariance of its one tile config.

CPU: the kernels run under the Triton interpreter (TRITON_INTERPRET=1) in a subprocess
(tests/triton_helpers.py); fp32, fp32 tolerance. GPU (`-m gpu`): 26B-A4B expert shapes in bf16.
"""
import importlib.util

import pytest
import torch
from triton_helpers import run_interpreter_checks

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _experts(num_experts: int, hidden: int, inter: int, dtype, device, gen):
    from fluxlab.models.diffusion_gemma.layers import GemmaExperts

    experts = GemmaExperts(num_experts, hidden, inter).to(device=device)
    with torch.no_grad():
        gate_up = torch.randn(experts.gate_up_proj.shape, generator=gen, device=device)
        experts.gate_up_proj.copy_(gate_up * hidden ** -0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen, device=device) * inter ** -0.5)
    return experts.to(dtype)


def _routing(num_tokens: int, num_experts: int, top_k: int, gen):
    device = gen.device
    scores = torch.rand(num_tokens, num_experts, generator=gen, device=device)
    index = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k, generator=gen, device=device) + 0.05
    return weights, index


def _interpreter_checks() -> None:
    from fluxlab.kernels.fused_moe import fused_moe
    from fluxlab.kernels.moe_config import MoEConfig

    gen = torch.Generator().manual_seed(0)
    small = MoEConfig(BLOCK_M=64, BLOCK_N1=32, BLOCK_K1=32, BLOCK_N2=16, BLOCK_K2=32, GROUP_M=2, SHRINK1=2, SHRINK2=2)
    for num_experts, hidden, inter, top_k, num_tokens in ((8, 64, 32, 2, 9), (16, 80, 48, 4, 33)):
        experts = _experts(num_experts, hidden, inter, torch.float32, "cpu", gen)
        x = torch.randn(num_tokens, hidden, generator=gen) * 2  # gate values well into gelu's curved part
        weights, index = _routing(num_tokens, num_experts, top_k, gen)
        want = experts(x, weights, index)  # transformers' loop
        with torch.no_grad():
            got = fused_moe(x, index, weights, experts.gate_up_proj, experts.down_proj, config=small,
                            activation="gelu_tanh")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # token 0 alone = token 0 among the others (the tile height it lands in changes with them)
        with torch.no_grad():
            alone = fused_moe(x[:1], index[:1], weights[:1], experts.gate_up_proj, experts.down_proj, config=small,
                              activation="gelu_tanh")
        torch.testing.assert_close(alone, got[:1], rtol=1e-6, atol=1e-6)
    try:
        fused_moe(x, index, weights, experts.gate_up_proj, experts.down_proj, activation="relu")
    except ValueError as err:
        assert "relu" in str(err)
    else:
        raise AssertionError("an unknown activation was accepted")
    print("interpreter checks ok")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (the CPU check runs it under TRITON_INTERPRET=1)")
def test_fused_gelu_moe_matches_the_transformers_loop_interpreter():
    run_interpreter_checks(__file__)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU and triton")
def test_canvas_moe_is_batch_invariant_on_26b_shapes():
    """bf16, E=128, H=2816, I=704, top-8: a canvas' 256 tokens give the same bits alone and inside
    8 and 64 canvases; values within bf16 rounding of the loop."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    experts = _experts(128, 2816, 704, torch.bfloat16, device, gen)
    x = torch.randn(64 * 256, 2816, generator=gen, device=device).to(torch.bfloat16)
    weights, index = _routing(64 * 256, 128, 8, gen)
    with torch.no_grad():
        outs = [experts(x[:n * 256], weights[:n * 256], index[:n * 256])[:256] for n in (1, 8, 64)]
        loop = torch.zeros_like(x[:256])
        for e in index[:256].unique().tolist():  # transformers' loop on the first canvas
            tok, slot = torch.where(index[:256] == e)
            gate, up = torch.nn.functional.linear(x[tok], experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(torch.nn.functional.gelu(gate, approximate="tanh") * up,
                                           experts.down_proj[e])
            loop.index_add_(0, tok, (y * weights[tok, slot, None]).to(loop.dtype))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    err = (outs[0].float() - loop.float()).norm() / loop.float().norm()
    assert err < 1e-2, err


if __name__ == "__main__":
    _interpreter_checks()
