"""The model against a plain per-token implementation written from the published definition."""
import math

import pytest
import torch
from safetensors.torch import load_file

from fluxlab.engine.layers.attention_dense import DenseBlockCausalAttention
from fluxlab.engine.layers.moe import moe_forward, moe_reference, route
from fluxlab.models.llada2.model import LLaDA2MoeConfig


pytestmark = pytest.mark.usefixtures("one_thread")


def _rms(x, w, eps):
    return w * (x / math.sqrt(float((x * x).mean()) + eps))


def _rope(vec, pos, rotary_dim, theta):
    out = vec.clone()
    half = rotary_dim // 2
    for i in range(half):
        angle = pos * theta ** (-(2 * i) / rotary_dim)
        a, b = vec[i], vec[i + half]
        out[i] = a * math.cos(angle) - b * math.sin(angle)
        out[i + half] = b * math.cos(angle) + a * math.sin(angle)
    return out


def _swiglu(x, g, u, d):
    return d @ (torch.nn.functional.silu(g @ x) * (u @ x))


def _moe_token(x, W, i, c: LLaDA2MoeConfig):
    p = f"model.layers.{i}.mlp."
    scores = torch.sigmoid(W[p + "gate.weight"] @ x)
    biased = scores + W[p + "gate.expert_bias"]
    per_group = c.num_experts // c.n_group
    group_score = [sorted(biased[g * per_group:(g + 1) * per_group].tolist())[-2:] for g in range(c.n_group)]
    kept_groups = sorted(range(c.n_group), key=lambda g: -sum(group_score[g]))[:c.topk_group]
    candidates = [e for e in range(c.num_experts) if e // per_group in kept_groups]
    chosen = sorted(candidates, key=lambda e: -float(biased[e]))[:c.num_experts_per_tok]
    weights = torch.stack([scores[e] for e in chosen])
    weights = weights / (weights.sum() + 1e-20) * c.routed_scaling_factor
    y = torch.zeros_like(x)
    for w, e in zip(weights, chosen):
        q = p + f"experts.{e}."
        y += w * _swiglu(x, W[q + "gate_proj.weight"], W[q + "up_proj.weight"], W[q + "down_proj.weight"])
    q = p + "shared_experts."
    return y + _swiglu(x, W[q + "gate_proj.weight"], W[q + "up_proj.weight"], W[q + "down_proj.weight"])


def dense_logits(W, c: LLaDA2MoeConfig, ids, block_length):
    """Straightforward fp32 LLaDA2-MoE from official tensor names: per token, explicit mask."""
    T, D = len(ids), c.head_dim
    nq, nkv = c.num_attention_heads, c.num_key_value_heads
    h = [W["model.word_embeddings.weight"][t].clone() for t in ids]
    dtype = h[0].dtype
    allowed = [[(j // block_length) <= (i // block_length) for j in range(T)] for i in range(T)]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        qs, ks, vs = [], [], []
        for t in range(T):
            qkv = W[p + "attention.query_key_value.weight"] @ _rms(h[t], W[p + "input_layernorm.weight"], c.rms_norm_eps)
            heads = qkv.view(nq + 2 * nkv, D)
            qs.append([_rope(_rms(heads[a], W[p + "attention.query_layernorm.weight"], c.rms_norm_eps), t,
                             c.rotary_dim, c.rope_theta) for a in range(nq)])
            ks.append([_rope(_rms(heads[nq + a], W[p + "attention.key_layernorm.weight"], c.rms_norm_eps), t,
                             c.rotary_dim, c.rope_theta) for a in range(nkv)])
            vs.append([heads[nq + nkv + a] for a in range(nkv)])
        new_h = []
        for t in range(T):
            outs = []
            for a in range(nq):
                kv = a // (nq // nkv)
                scores = torch.tensor([float(qs[t][a] @ ks[j][kv]) / math.sqrt(D) if allowed[t][j] else -math.inf
                                       for j in range(T)], dtype=dtype)
                probs = torch.softmax(scores, 0)
                outs.append(sum(probs[j] * vs[j][kv] for j in range(T) if allowed[t][j]))
            x = h[t] + W[p + "attention.dense.weight"] @ torch.cat(outs)
            xn = _rms(x, W[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            if c.is_moe_layer(i):
                x = x + _moe_token(xn, W, i, c)
            else:
                x = x + _swiglu(xn, W[p + "mlp.gate_proj.weight"], W[p + "mlp.up_proj.weight"], W[p + "mlp.down_proj.weight"])
            new_h.append(x)
        h = new_h
    return torch.stack([W["lm_head.weight"] @ _rms(x, W["model.norm.weight"], c.rms_norm_eps) for x in h])


def test_logits_match_plain_dense_implementation(tiny_ckpt, tiny_model):
    model, config = tiny_model
    W = load_file(str(tiny_ckpt / "model.safetensors"))
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (21,))
    block = 8
    hidden = model(ids, torch.arange(len(ids)), DenseBlockCausalAttention([len(ids)], block))
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    # The plain version runs in float64: it is the exact value; the fp32 model may only differ by
    # fp32 rounding, i.e. 1e-5 relative to the logits' scale (they reach ~50 with the peaked head).
    expected = dense_logits({k: v.double() for k, v in W.items()}, config, ids.tolist(), block)
    scale = float(expected.abs().max())
    assert scale > 1.0
    torch.testing.assert_close(logits.double(), expected, rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(logits.softmax(-1).double(), expected.softmax(-1), rtol=0, atol=1e-5)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_batch_of_sequences_equals_each_alone(tiny_model):
    model, config = tiny_model
    a, b = torch.randint(0, config.vocab_size, (13,)), torch.randint(0, config.vocab_size, (40,))
    both = model(torch.cat([a, b]), torch.cat([torch.arange(13), torch.arange(40)]),
                 DenseBlockCausalAttention([13, 40], 8))
    alone_a = model(a, torch.arange(13), DenseBlockCausalAttention([13], 8))
    alone_b = model(b, torch.arange(40), DenseBlockCausalAttention([40], 8))
    torch.testing.assert_close(both, torch.cat([alone_a, alone_b]), rtol=1e-5, atol=1e-5)


def test_later_blocks_never_change_earlier_ones(tiny_model):
    model, config = tiny_model
    ids = torch.randint(0, config.vocab_size, (24,))
    full = model(ids, torch.arange(24), DenseBlockCausalAttention([24], 8))
    changed = ids.clone()
    changed[16:] = (changed[16:] + 1) % config.vocab_size
    other = model(changed, torch.arange(24), DenseBlockCausalAttention([24], 8))
    # equal up to fp32 rounding: the MoE's per-expert GEMMs see different row counts
    torch.testing.assert_close(full[:16], other[:16], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(full[16:], other[16:])


def _random_moe(T=37, E=16, H=24, inter=12, k=4, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    gate = torch.randn(E, H, generator=g)
    bias = torch.randn(E, generator=g) * 0.1
    w_gu = (torch.randn(E, 2 * inter, H, generator=g) / H**0.5).to(dtype)
    w_d = (torch.randn(E, H, inter, generator=g) / inter**0.5).to(dtype)
    idx, w = route(x, gate, bias, top_k=k, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    return x, idx, w, w_gu, w_d


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vectorised_moe_equals_per_expert_loop(dtype):
    x, idx, w, w_gu, w_d = _random_moe(dtype=dtype)
    ref = moe_reference(x, idx, w, w_gu, w_d)
    out = moe_forward(x, idx, w, w_gu, w_d, use_grouped_mm=False)
    assert out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_vectorised_moe_with_some_experts_unused():
    x, idx, w, w_gu, w_d = _random_moe(T=2)
    assert len(idx.unique()) < 16
    torch.testing.assert_close(moe_forward(x, idx, w, w_gu, w_d, use_grouped_mm=False),
                               moe_reference(x, idx, w, w_gu, w_d), rtol=1e-6, atol=1e-6)


def test_router_bias_only_chooses_and_weights_are_renormalised_scores():
    # 4 experts in 2 groups; the bias pushes expert 3 (low score) into the top-2 and groups are
    # limited to 1, so both chosen experts must come from group {2, 3}.
    x = torch.ones(1, 1)
    gate = torch.tensor([[2.0], [1.5], [1.0], [-1.0]])
    bias = torch.tensor([0.0, 0.0, 0.3, 1.0])
    idx, w = route(x, gate, bias, top_k=2, n_group=2, topk_group=1, routed_scaling_factor=2.5)
    assert sorted(idx[0].tolist()) == [2, 3]
    s = torch.sigmoid(gate[:, 0])
    expected = {2: s[2] / (s[2] + s[3]) * 2.5, 3: s[3] / (s[2] + s[3]) * 2.5}
    for e, weight in zip(idx[0].tolist(), w[0]):
        assert weight.item() == pytest.approx(expected[e].item(), rel=1e-6)
    assert w.sum().item() == pytest.approx(2.5, rel=1e-6)
    # without the bias the best group is {0, 1}
    idx0, _ = route(x, gate, torch.zeros(4), top_k=2, n_group=2, topk_group=1, routed_scaling_factor=2.5)
    assert sorted(idx0[0].tolist()) == [0, 1]


def test_router_logits_are_fp32_in_bf16_model():
    x, idx, w, *_ = _random_moe(dtype=torch.bfloat16)
    assert w.dtype == torch.float32 and idx.dtype == torch.int64
    assert torch.allclose(w.sum(-1), torch.full((x.shape[0],), 2.5), atol=1e-5)


def test_config_round_trip_keeps_unknown_keys():
    d = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "num_experts": 16, "n_group": 4, "topk_group": 2, "some_future_key": [1, 2]}
    c = LLaDA2MoeConfig.from_dict(d)
    assert c.use_qk_norm is True  # absent from published files, defaults to true
    out = c.to_dict()
    assert out["some_future_key"] == [1, 2] and out["hidden_size"] == 64
    assert LLaDA2MoeConfig.from_dict(out) == c
