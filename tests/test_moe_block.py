"""The MoE block's stacked weight (layers/linear.StackedRows): the shared expert's gate and up rows
and the router's in one tensor that the three parameters view, multiplied in one GEMM with an fp32
output on the fused path. On CPU under the Triton interpreter (fp32, the fused path forced on) it
gives the unstacked block's output and routing; loading and in-place updates reach the stack, and a
parameter moved off it turns the stacked path off instead of reading stale rows. On a GPU (`-m gpu`,
bf16, LLaDA2.0-mini's MoE shapes) the same output within bf16 rounding and the same routing."""
from __future__ import annotations

import importlib.util
import os
import sys
from unittest import mock

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from triton_helpers import run_interpreter_checks  # noqa: E402

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def small_config():
    from fluxlab.models.llada2.model import LLaDA2MoeConfig

    return LLaDA2MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16,
                           n_group=4, topk_group=2, num_experts_per_tok=4, moe_intermediate_size=32,
                           num_hidden_layers=2, vocab_size=100)


def stacked_and_plain(block, x, residual, expect_stacked: bool = True):
    """(output with the stack, output without it) with the fused kernels forced on; the first call
    must (not) take the stacked path."""
    from fluxlab.models.llada2 import model as llada2_moe

    with mock.patch.object(llada2_moe, "use_fused", lambda t: True), \
            mock.patch.object(llada2_moe, "mm_fp32_out_works", lambda d: True), \
            mock.patch.object(block, "_stacked_forward", wraps=block._stacked_forward) as stacked:
        got = block(x, residual)
        assert stacked.call_count == int(expect_stacked)
    plain = block.stacked
    block.stacked = None
    try:
        want = block(x, residual)
    finally:
        block.stacked = plain
    return got, want


def _interpreter_checks() -> None:
    from fluxlab.models.llada2.loader import build_random_model

    model, c = build_random_model(small_config(), dtype=torch.float32, seed=3)
    block = model.layers[1].mlp
    shared, gate = block.shared_experts, block.gate
    # the loader filled the stack through the parameters' views
    assert torch.equal(block.stacked.weight, torch.cat([shared.gate_proj.weight, shared.up_proj.weight, gate.weight]))
    assert block.stacked.weight.abs().sum() > 0
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 24, 64, generator=gen)
    with torch.no_grad():
        got, want = stacked_and_plain(block, x, residual)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # an in-place update of one weight reaches the stacked GEMM
        gate.weight.mul_(-1)
        flipped, want_flipped = stacked_and_plain(block, x, residual)
        torch.testing.assert_close(flipped, want_flipped, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(flipped, got)
    # LLaDA2.2 block routing (expert pools per routing block) takes the stacked GEMM's logits too
    from fluxlab.models.llada2.model import LLaDA2MoeConfig

    pooled = LLaDA2MoeConfig(**{**small_config().to_dict(), "expert_capacity": 6, "block_size": 8})
    pooled_block = build_random_model(pooled, dtype=torch.float32, seed=4)[0].layers[1].mlp
    with torch.no_grad():
        got_pooled, want_pooled = stacked_and_plain(pooled_block, x, residual)
    torch.testing.assert_close(got_pooled, want_pooled, rtol=1e-5, atol=1e-5)
    # a parameter given its own storage (module.to) is no longer in the stack: the block stops using it
    block.to(torch.float64).to(torch.float32)
    assert not block.stacked.current()
    with torch.no_grad():
        got, want = stacked_and_plain(block, x, residual, expect_stacked=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # (the forced-on silu_mul is not torch's exp)
    print("interpreter checks ok")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_stacked_weight_under_the_triton_interpreter():
    run_interpreter_checks(__file__)


def test_tensor_parallel_and_no_shared_expert_have_no_stack():
    from fluxlab.engine.layers.linear import ParallelDims
    from fluxlab.models.llada2.model import LLaDA2MoeConfig, LLaDA2MoeSparseMoeBlock

    c = small_config()
    assert LLaDA2MoeSparseMoeBlock(c, torch.float32).stacked is not None
    assert LLaDA2MoeSparseMoeBlock(c, torch.float32, dims=ParallelDims(0, 2)).stacked is None
    no_shared = LLaDA2MoeConfig(**{**c.to_dict(), "num_shared_experts": 0})
    assert LLaDA2MoeSparseMoeBlock(no_shared, torch.float32).stacked is None


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("num_tokens", [32, 2048])
def test_stacked_block_gives_the_unstacked_output_on_gpu(num_tokens):
    from fluxlab.models.llada2.loader import build_random_model
    from fluxlab.models.llada2.model import LLaDA2MoeConfig

    c = LLaDA2MoeConfig(num_hidden_layers=2, vocab_size=1024)  # LLaDA2.0-mini's layer shapes
    model, _ = build_random_model(c, dtype=torch.bfloat16, device="cuda", seed=1)
    block = model.layers[1].mlp
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, c.hidden_size, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(num_tokens, c.hidden_size, device="cuda", generator=gen).bfloat16()
    with torch.no_grad():
        routed = block.gate(x)[0]
        logits = torch.mm(x, block.stacked.weight.t(), out_dtype=torch.float32)[:, -c.num_experts:]
        same = (block.gate.route(logits, fused=True)[0] == routed).all(dim=1).float().mean().item()
        got, want = stacked_and_plain(block, x, residual)
    assert same >= 0.99, same
    err = (got.float() - want.float()).norm() / (want.float() - residual.float()).norm()
    assert err < 2e-2, err


if __name__ == "__main__":
    _interpreter_checks()
