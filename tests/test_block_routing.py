"""LLaDA2.2 block routing (DESIGN §4b): the router against a plain per-block loop, its limits, the
host-side alignment check, every MoE backend on block-routed choices, and the tiny_llada22 model.

CPU; the Triton kernel runs under the interpreter in a subprocess when triton is installed."""
import importlib.util

import numpy as np
import pytest
import torch
from triton_helpers import run_interpreter_checks

from fluxlab.engine.layers.moe import (StackedExperts, check_routing_blocks, local_routing, moe_forward,
                                       moe_reference, partial_moe, route)

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _router(T=32, E=16, H=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g), torch.randn(E, H, generator=g), torch.randn(E, generator=g) * 0.1


def _per_block_loop(x, gate, bias, *, top_k, capacity, block_size, scale):
    """The rule of DESIGN §4b written one routing block and one token at a time."""
    s = torch.sigmoid(x.float() @ gate.float().T)
    r = s + bias
    idx, weights, pools = [], [], []
    for start in range(0, x.shape[0], block_size):
        rows = r[start:start + block_size]
        block_max = rows.max(dim=0).values.tolist()
        pool = sorted(range(len(block_max)), key=lambda e: -block_max[e])[:capacity]
        pools.append(set(pool))
        for t in range(start, start + block_size):
            chosen = sorted(pool, key=lambda e: -float(r[t, e]))[:top_k]
            w = torch.stack([s[t, e] for e in chosen])
            idx.append(chosen)
            weights.append((w / (w.sum() + 1e-20) * scale).tolist())
    return idx, weights, pools


def _as_sorted(idx, w):
    """(expert -> weight) per token, order-free."""
    return [dict(zip(i, ww)) for i, ww in zip(idx.tolist(), w.tolist())]


@pytest.mark.parametrize("block_size,capacity", [(8, 6), (16, 5), (32, 8)])
def test_pool_per_routing_block_and_chosen_experts_equal_a_plain_per_block_loop(block_size, capacity):
    x, gate, bias = _router(T=64)
    idx, w = route(x, gate, bias, top_k=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                   expert_capacity=capacity, routing_block_size=block_size)
    want_idx, want_w, pools = _per_block_loop(x, gate, bias, top_k=4, capacity=capacity, block_size=block_size,
                                              scale=2.5)
    got = _as_sorted(idx, w)
    for t, (experts, weights) in enumerate(zip(want_idx, want_w)):
        assert set(got[t]) == set(experts)
        for e, weight in zip(experts, weights):
            assert got[t][e] == pytest.approx(weight, rel=1e-6)
        assert set(experts) <= pools[t // block_size]
    # routed_scaling_factor is applied once: the weights of a token sum to it
    torch.testing.assert_close(w.sum(-1), torch.full((64,), 2.5), rtol=1e-6, atol=1e-6)


def test_the_pool_really_restricts_the_choice():
    x, gate, bias = _router(T=32)
    free, _ = route(x, gate, bias, top_k=4, n_group=1, topk_group=1, routed_scaling_factor=1.0)
    routed, _ = route(x, gate, bias, top_k=4, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                      expert_capacity=6, routing_block_size=8)
    assert not torch.equal(free.sort(-1).values, routed.sort(-1).values)
    for b in range(4):
        assert len(routed[8 * b:8 * (b + 1)].unique()) <= 6


def test_capacity_equal_to_the_expert_count_is_top_k_without_groups():
    x, gate, bias = _router(T=48)
    plain_idx, plain_w = route(x, gate, bias, top_k=4, n_group=1, topk_group=1, routed_scaling_factor=2.5)
    idx, w = route(x, gate, bias, top_k=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                   expert_capacity=16, routing_block_size=16)
    assert torch.equal(idx, plain_idx)
    torch.testing.assert_close(w, plain_w, rtol=0, atol=0)


def test_bias_only_chooses_weights_are_unbiased_scores():
    x, gate, _ = _router(T=8, E=8)
    bias = torch.zeros(8)
    bias[7] = 10.0  # expert 7 wins every choice, its weight still comes from its own sigmoid score
    idx, w = route(x, gate, bias, top_k=2, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                   expert_capacity=2, routing_block_size=8)
    s = torch.sigmoid(x @ gate.T)
    assert (idx == 7).any(-1).all()
    for t in range(8):
        e0, e1 = idx[t].tolist()
        assert w[t, idx[t].tolist().index(7)].item() == pytest.approx((s[t, 7] / (s[t, e0] + s[t, e1])).item(),
                                                                      rel=1e-6)


def test_router_refuses_tokens_that_are_not_whole_routing_blocks():
    x, gate, bias = _router(T=20)
    with pytest.raises(ValueError, match="not whole routing blocks of 8"):
        route(x, gate, bias, top_k=4, n_group=1, topk_group=1, routed_scaling_factor=1.0, expert_capacity=6,
              routing_block_size=8)


def test_two_misaligned_requests_are_caught_although_their_lengths_add_up_to_a_routing_block():
    positions = np.concatenate([np.arange(16), np.arange(16)])  # two rows of 16 tokens, routing block 32
    with pytest.raises(ValueError, match=r"tokens 0\.\.31 of the forward hold positions \[0, 1, .*15, 0, 1"):
        check_routing_blocks(positions, 32)


def test_routing_check_accepts_whole_aligned_blocks_and_catches_other_breaks():
    # prefill chunk of two blocks of 32 + a decode row at block 3 + graph padding row at 0..31
    ok = np.concatenate([np.arange(64), np.arange(96, 128), np.arange(32)])
    check_routing_blocks(ok, 32, row_starts=[0, 64, 96])
    check_routing_blocks(np.arange(64), 32)  # several routing blocks inside one decode block
    with pytest.raises(ValueError, match="not one aligned routing block"):
        check_routing_blocks(np.arange(8, 40), 32)  # off alignment
    with pytest.raises(ValueError, match="not whole routing blocks"):
        check_routing_blocks(np.arange(48), 32)
    # positions alone look aligned (32..63) but the tokens belong to two requests of 16
    with pytest.raises(ValueError, match="row starts at flat token 16"):
        check_routing_blocks(np.arange(32, 64), 32, row_starts=[0, 16])
    check_routing_blocks([5, 7, 9], 0)  # no block routing: nothing to check


def _block_routed_moe(T=64, E=16, H=24, inter=12, seed=1):
    x, gate, bias = _router(T=T, E=E, H=H, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    w_gu = torch.randn(E, 2 * inter, H, generator=g) / H**0.5
    w_d = torch.randn(E, H, inter, generator=g) / inter**0.5
    idx, w = route(x, gate, bias, top_k=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                   expert_capacity=6, routing_block_size=8)
    return x, idx, w, w_gu, w_d


def test_every_cpu_moe_backend_agrees_on_block_routed_choices():
    x, idx, w, w_gu, w_d = _block_routed_moe()
    ref = moe_reference(x, idx, w, w_gu, w_d)
    torch.testing.assert_close(moe_forward(x, idx, w, w_gu, w_d, use_grouped_mm=False), ref, rtol=1e-6, atol=1e-6)
    for backend in ("loop", "torch", "grouped_mm"):
        experts = StackedExperts(16, 24, 12, torch.float32)
        experts.w_gate_up.data.copy_(w_gu)
        experts.w_down.data.copy_(w_d)
        experts.backend = backend
        torch.testing.assert_close(experts(x, idx, w), ref, rtol=1e-6, atol=1e-6)
    # expert parallel over 2 ranks: the partial sums of both ranks add up to the whole
    total = torch.zeros_like(ref)
    for rank in range(2):
        local_idx, weight, mine = local_routing(idx, w, rank * 8, 8)
        total += partial_moe(x, local_idx, weight, mine, w_gu[8 * rank:8 * (rank + 1)], w_d[8 * rank:8 * (rank + 1)])
    torch.testing.assert_close(total, ref, rtol=1e-5, atol=1e-5)


def _interpreter_checks() -> None:
    """Runs in the TRITON_INTERPRET=1 subprocess: the fused kernel on block-routed choices."""
    from fluxlab.kernels.fused_moe import fused_moe

    x, idx, w, w_gu, w_d = _block_routed_moe(T=16)
    ref = moe_reference(x, idx, w, w_gu, w_d)
    out = fused_moe(x, idx, w, w_gu, w_d)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), (out - ref).abs().max()
    print("interpreter checks ok")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_triton_fused_moe_agrees_on_block_routed_choices():
    run_interpreter_checks(__file__)


# ------------------------------------------------------------------------------ tiny_llada22 model

@pytest.fixture(scope="module")
def llada22(tmp_path_factory):
    from fluxlab.checkpoint import ensure_tiny_checkpoint
    from fluxlab.models.llada2.loader import load_model

    path = ensure_tiny_checkpoint(tmp_path_factory.mktemp("cache22"), preset="tiny_llada22")
    model, config = load_model(path, torch.float32, "cpu", progress=False)
    return path, model, config


def test_tiny_llada22_routes_in_blocks_and_its_moe_output_is_the_published_sum(llada22):
    _, model, c = llada22
    assert (c.expert_capacity, c.routing_block_size) == (6, 8)
    moe = model.layers[1].mlp
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, c.hidden_size, generator=g)
    idx, w = moe.gate(x)
    for b in range(2):
        assert len(idx[8 * b:8 * (b + 1)].unique()) <= 6
    # output = sum of weight * expert(x) + shared expert, the 2.5 scale inside the weights once
    s = torch.sigmoid(x @ moe.gate.weight.T)
    want = torch.zeros_like(x)
    for t in range(16):
        chosen = idx[t].tolist()
        scores = torch.stack([s[t, e] for e in chosen])
        weights = scores / scores.sum() * c.routed_scaling_factor
        for e, weight in zip(chosen, weights):
            gate_up = moe.experts.w_gate_up[e] @ x[t]
            gate, up = gate_up.chunk(2)
            want[t] += weight * (moe.experts.w_down[e] @ (torch.nn.functional.silu(gate) * up))
    want += moe.shared_experts(x)
    torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)


def test_tiny_llada22_batch_of_requests_equals_each_alone(llada22):
    from fluxlab.engine.layers.attention_dense import DenseBlockCausalAttention

    _, model, c = llada22
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, c.vocab_size, (32,), generator=g), torch.randint(0, c.vocab_size, (16,), generator=g)
    together = model(torch.cat([a, b]), torch.cat([torch.arange(32), torch.arange(16)]),
                     DenseBlockCausalAttention([32, 16], 16))
    alone_a = model(a, torch.arange(32), DenseBlockCausalAttention([32], 16))
    alone_b = model(b, torch.arange(16), DenseBlockCausalAttention([16], 16))
    torch.testing.assert_close(together, torch.cat([alone_a, alone_b]), rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    _interpreter_checks()


@pytest.mark.parametrize("layout", ["parallel=tp2_ep2", "parallel=tp2"])
def test_tiny_llada22_under_tp_and_ep_gives_the_tp1_tokens(llada22, layout):
    from fluxlab.engine.request import SamplingParams
    from fluxlab.llm import LLM

    path = llada22[0]
    base = ["engine.dtype=float32", "engine.device=cpu", "decoding.block_length=16", "model.max_model_len=128",
            "model.max_new_tokens=64", "scheduler.max_num_seqs=2", "scheduler.max_scheduled_tokens=64", "parallel.startup_timeout_s=300"]
    prompts = ["The ducks at the market", "Let us think step by step about"]
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    tp1 = LLM(model=str(path), overrides=base)
    try:
        want = [r.token_ids for r in tp1.generate(prompts, params)]
    finally:
        tp1.shutdown()
    llm = LLM(model=str(path), overrides=base + [layout])
    try:
        assert [r.token_ids for r in llm.generate(prompts, params)] == want
        assert llm.engine.kv_free_pages == llm.engine.kv_total_pages
    finally:
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_block_routing_captures_in_a_cuda_graph_and_replays_as_eager():
    x, gate, bias = _router(T=64)
    x, gate, bias = x.cuda().bfloat16(), gate.cuda().bfloat16(), bias.cuda()
    kw = dict(top_k=4, n_group=4, topk_group=2, routed_scaling_factor=2.5, expert_capacity=6, routing_block_size=8)
    static_x = x.clone()
    route(static_x, gate, bias, **kw)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_idx, graph_w = route(static_x, gate, bias, **kw)
    static_x.copy_(x.flip(0))
    graph.replay()
    eager_idx, eager_w = route(x.flip(0), gate, bias, **kw)
    assert torch.equal(graph_idx, eager_idx) and torch.equal(graph_w, eager_w)
