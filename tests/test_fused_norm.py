"""fused_norm (rms_norm, add_rms_norm, qk_norm_rope) and route_topk kernels against the torch layers.

CPU: the Triton kernels run under the interpreter (TRITON_INTERPRET=1) in a subprocess, as in
tests/test_fused_moe.py; fp32 to 1e-5 and, since the interpreter handles bf16, bf16 against torch's
CPU bf16 path to <= 1 bf16 ulp (almost always bit-equal: only the fp32 sum-of-squares order and
rsqrt differ). Router: identical expert ids (inputs without ties), weights within 1e-6.
GPU (`-m gpu`): bf16 on CUDA against the torch path, <= 1 ulp (and the fraction of exact elements
reported / bounded), router ids identical, and CUDA-graph replay.
"""
import importlib.util

import pytest
import torch
from triton_helpers import run_interpreter_checks

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _ulp_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    """Max distance in units of the last place between two bf16/fp16 tensors (same sign assumed
    away: the int16 views of IEEE halves are monotone per sign, so compare through int32)."""
    ai = a.contiguous().view(torch.int16).int()
    bi = b.contiguous().view(torch.int16).int()
    # map sign-magnitude to a monotone integer line
    ai = torch.where(ai < 0, -(ai & 0x7FFF), ai)
    bi = torch.where(bi < 0, -(bi & 0x7FFF), bi)
    return int((ai - bi).abs().max().item()) if a.numel() else 0


def _ref_qk_norm_rope(qkv, positions, qw, kw, eps, cos_cache, sin_cache, hq, hkv, d, rd):
    from fluxlab.engine.layers.norm import rms_norm
    from fluxlab.engine.layers.rotary import apply_partial_rotary

    T = qkv.shape[0]
    qkv = qkv.view(T, hq + 2 * hkv, d)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)
    if qw is not None:
        q, k = rms_norm(q, qw, eps), rms_norm(k, kw, eps)
    cos = cos_cache[positions].to(qkv.dtype)[:, None, :]
    sin = sin_cache[positions].to(qkv.dtype)[:, None, :]
    return apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin), v.contiguous()


def _rope_operand_scales(qkv, positions, qw, kw, eps, cos_cache, sin_cache, hq, hkv, d, rd):
    """Per output element the size of what RoPE adds, |x cos| + |rotate_half(x) sin| (|x| past the rotary
    dims), x the normed q / k; v's elements are themselves."""
    q, k, v = _ref_qk_norm_rope(qkv, positions, qw, kw, eps, cos_cache[:, :0], sin_cache[:, :0], hq, hkv, d, 0)
    cos = cos_cache[positions].to(qkv.dtype)[:, None, :].float().abs()
    sin = sin_cache[positions].to(qkv.dtype)[:, None, :].float().abs()

    def scale(x):
        x = x.float().abs()
        rot = torch.cat([x[..., rd // 2:rd], x[..., :rd // 2]], dim=-1)
        return torch.cat([x[..., :rd] * cos + rot * sin, x[..., rd:]], dim=-1)

    return scale(q), scale(k), v.float().abs()


def _route_inputs(T, H, E, gen, dtype=torch.float32, device="cpu"):
    x = torch.randn(T, H, generator=gen).to(device, dtype)
    gw = (torch.randn(E, H, generator=gen) * H ** -0.5).to(device, dtype)
    bias = (torch.randn(E, generator=gen) * 0.05).to(device)
    return x, gw, bias


def _interpreter_checks() -> None:
    """Runs in the TRITON_INTERPRET=1 subprocess."""
    from fluxlab.engine.layers.moe import route
    from fluxlab.engine.layers.norm import rms_norm as ref_rms_norm
    from fluxlab.engine.layers.rotary import PartialRotary
    from fluxlab.kernels.fused_norm import add_rms_norm, qk_norm_rope, qk_norm_rope_to_cache, rms_norm

    gen = torch.Generator().manual_seed(0)

    # --- rms_norm / add_rms_norm
    for n, d in [(1, 64), (7, 96), (33, 256)]:
        for dt in (torch.float32, torch.bfloat16):
            x = (torch.randn(n, d, generator=gen) * 3).to(dt)
            w = (1 + 0.1 * torch.randn(d, generator=gen)).to(dt)
            ref, out = ref_rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6)
            assert out.shape == ref.shape and out.dtype == ref.dtype
            if dt == torch.float32:
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            else:
                assert _ulp_diff(out, ref) <= 1, (n, d, _ulp_diff(out, ref))
            r = (torch.randn(n, d, generator=gen) * 3).to(dt)
            normed, new_r = add_rms_norm(x, r, w, 1e-6)
            torch.testing.assert_close(new_r, x + r, rtol=0, atol=0)
            ref2 = ref_rms_norm(x + r, w, 1e-6)
            if dt == torch.float32:
                torch.testing.assert_close(normed, ref2, rtol=1e-5, atol=1e-5)
            else:
                assert _ulp_diff(normed, ref2) <= 1
    # strided rows (a column slice of a wider tensor) and 3-D input
    x = torch.randn(5, 3, 64, generator=gen)
    w = torch.randn(64, generator=gen)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    big = torch.randn(6, 200, generator=gen)
    torch.testing.assert_close(rms_norm(big[:, 8:72], w, 1e-6), ref_rms_norm(big[:, 8:72], w, 1e-6),
                               rtol=1e-5, atol=1e-5)

    # --- qk_norm_rope: (Hq, Hkv, D, rd) incl. LLaDA2's D=128, rd=64 and a non-pow2 head_dim
    for hq, hkv, d, rd, T, norm in [(4, 2, 128, 64, 5, True), (2, 1, 32, 32, 3, True), (4, 1, 48, 16, 4, False),
                                    (16, 4, 128, 64, 2, True)]:
        rope = PartialRotary(d, rd, 10000.0, max_positions=64)
        positions = torch.randint(0, 64, (T,), generator=gen)
        for dt in (torch.float32, torch.bfloat16):
            qkv = (torch.randn(T, (hq + 2 * hkv) * d, generator=gen) * 2).to(dt)
            qw = (1 + 0.1 * torch.randn(d, generator=gen)).to(dt) if norm else None
            kw = (1 + 0.1 * torch.randn(d, generator=gen)).to(dt) if norm else None
            args = (qkv, positions, qw, kw, 1e-6, rope.cos_cache, rope.sin_cache, hq, hkv, d, rd)
            refs = _ref_qk_norm_rope(*args)
            outs = qk_norm_rope(*args)
            # the model's form: per-token tables already cast, no positions
            cos_t = rope.cos_cache[positions].to(dt)
            sin_t = rope.sin_cache[positions].to(dt)
            outs2 = qk_norm_rope(qkv, None, qw, kw, 1e-6, cos_t, sin_t, hq, hkv, d, rd)
            # k/v straight to cache slot rows (a shuffled subset of 2T slots), q unchanged
            slots = torch.randperm(2 * T, generator=gen)[:T]
            k_rows = torch.zeros(2 * T, hkv, d, dtype=dt)
            v_rows = torch.zeros(2 * T, hkv, d, dtype=dt)
            q3 = qk_norm_rope_to_cache(qkv, None, qw, kw, 1e-6, cos_t, sin_t, hq, hkv, d, rd, k_rows, v_rows, slots)
            assert torch.equal(q3, outs[0]) and torch.equal(k_rows[slots], outs[1]) and torch.equal(v_rows[slots], outs[2])
            untouched = torch.ones(2 * T, dtype=torch.bool).index_fill_(0, slots, False)
            assert not k_rows[untouched].any() and not v_rows[untouched].any()
            for name, ref, out, out2 in zip("qkv", refs, outs, outs2):
                assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous(), name
                torch.testing.assert_close(out2, out, rtol=0, atol=0)
                if dt == torch.float32:
                    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
                elif not norm or name == "v":
                    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # pure RoPE/copy: bit-exact
                else:
                    # a 1-ulp norm difference can grow by one more rounding through RoPE
                    assert _ulp_diff(out, ref) <= 2, (name, hq, hkv, d, rd, _ulp_diff(out, ref))

    # --- route_topk: real (E=256, 8 groups, top-8 of 4 groups) and tiny shapes, no ties
    for T, H, E, k, ng, kg in [(5, 64, 256, 8, 8, 4), (9, 32, 16, 4, 4, 2), (3, 32, 16, 4, 1, 1),
                               (4, 32, 64, 1, 8, 2), (6, 32, 24, 6, 3, 2)]:
        x, gw, bias = _route_inputs(T, H, E, gen)
        for b in (bias, None):
            ref_idx, ref_w = route(x, gw, b, top_k=k, n_group=ng, topk_group=kg, routed_scaling_factor=2.5)
            idx, wts = route_topk(x, gw, b, k, ng, kg, 2.5)
            assert idx.dtype == torch.int64 and wts.dtype == torch.float32
            assert torch.equal(idx, ref_idx), (T, E, k, ng, kg, idx, ref_idx)
            torch.testing.assert_close(wts, ref_w, rtol=0, atol=1e-6)
    x, gw, bias = _route_inputs(3, 32, 16, gen)
    idx32, _ = route_topk(x, gw, bias, 4, 4, 2, 1.0, idx_dtype=torch.int32)
    assert idx32.dtype == torch.int32
    assert torch.equal(idx32.long(), route(x, gw, bias, top_k=4, n_group=4, topk_group=2,
                                           routed_scaling_factor=1.0)[0])
    # shared_id: the routed columns unchanged, then every token's slot of the shared expert, weight 1;
    # the torch path (route_logits unfused) gives the same
    from fluxlab.engine.layers.moe import route_logits, router_logits
    from fluxlab.kernels.route_topk import route_topk_from_logits

    x, gw, bias = _route_inputs(5, 64, 256, gen)
    logits = router_logits(x, gw)
    idx, wts = route_topk_from_logits(logits, bias, 8, 8, 4, 2.5)
    idx_s, wts_s = route_topk_from_logits(logits, bias, 8, 8, 4, 2.5, shared_id=256)
    assert idx_s.shape == (5, 9) and torch.equal(idx_s[:, :8], idx) and torch.equal(wts_s[:, :8], wts)
    assert (idx_s[:, 8] == 256).all() and (wts_s[:, 8] == 1.0).all()
    ref_idx, ref_w = route_logits(logits, bias, top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                                  shared_id=256)
    assert torch.equal(idx_s, ref_idx)
    torch.testing.assert_close(wts_s, ref_w, rtol=0, atol=1e-6)
    print("interpreter checks ok")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (the CPU check runs it under TRITON_INTERPRET=1)")
def test_fused_norm_kernels_interpreter():
    run_interpreter_checks(__file__)


# ---------------------------------------------------------------------------------------------- GPU

def _gpu_ok():
    return HAVE_TRITON and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs CUDA (sm80+) and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 32, 1000])
def test_rms_norm_gpu_matches_torch(dtype, num_tokens):
    from fluxlab.engine.layers.norm import rms_norm as ref_rms_norm
    from fluxlab.kernels.fused_norm import add_rms_norm, rms_norm

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(num_tokens, 2048, device="cuda", generator=gen).mul(3).to(dtype)
    r = torch.randn(num_tokens, 2048, device="cuda", generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(2048, device="cuda", generator=gen)).to(dtype)
    ref, out = ref_rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6)
    assert _ulp_diff(out, ref) <= 1
    assert (out == ref).float().mean().item() > 0.99   # bit-equal except rare reduction-order ties
    normed, new_r = add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(new_r, x + r)
    assert _ulp_diff(normed, ref_rms_norm(x + r, w, 1e-6)) <= 1


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs CUDA (sm80+) and triton")
@pytest.mark.parametrize("num_tokens", [1, 32, 513])
def test_qk_norm_rope_gpu_matches_torch(num_tokens):
    from fluxlab.engine.layers.rotary import PartialRotary
    from fluxlab.kernels.fused_norm import qk_norm_rope

    gen = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d, rd = 16, 4, 128, 64
    rope = PartialRotary(d, rd, 600000.0, max_positions=8192).cuda()
    positions = torch.randint(0, 8192, (num_tokens,), device="cuda", generator=gen)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, device="cuda", generator=gen).mul(2).bfloat16()
    qw = (1 + 0.1 * torch.randn(d, device="cuda", generator=gen)).bfloat16()
    kw = (1 + 0.1 * torch.randn(d, device="cuda", generator=gen)).bfloat16()
    args = (qkv, positions, qw, kw, 1e-6, rope.cos_cache, rope.sin_cache, hq, hkv, d, rd)
    refs, outs = _ref_qk_norm_rope(*args), qk_norm_rope(*args)
    scales = _rope_operand_scales(*args)
    for name, ref, out, scale in zip("qkv", refs, outs, scales):
        assert out.is_contiguous() and out.shape == ref.shape
        same = (out == ref).float().mean().item()
        # The fp32 sum of squares is reduced in another order than torch's, which can move a normed value
        # by one ulp; RoPE's x*cos + rot*sin can cancel, so the bound is in ulps of its operands.
        ulp = torch.exp2(torch.floor(torch.log2(scale.clamp_min(1e-30))) - 7)
        excess = ((out.float() - ref.float()).abs() - 2 * ulp).max().item()
        assert excess <= 0 and same > 0.99, (name, excess, same)
    # without the norm, RoPE alone is bit-exact
    refs, outs = _ref_qk_norm_rope(qkv, positions, None, None, 1e-6, rope.cos_cache, rope.sin_cache, hq, hkv, d, rd), \
        qk_norm_rope(qkv, positions, None, None, 1e-6, rope.cos_cache, rope.sin_cache, hq, hkv, d, rd)
    for ref, out in zip(refs, outs):
        assert torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs CUDA (sm80+) and triton")
@pytest.mark.parametrize("num_tokens", [1, 32, 777])
def test_route_topk_gpu_matches_route(num_tokens):
    from fluxlab.engine.layers.moe import route

    gen = torch.Generator().manual_seed(num_tokens)
    x, gw, bias = _route_inputs(num_tokens, 2048, 256, gen, dtype=torch.bfloat16, device="cuda")
    ref_idx, ref_w = route(x, gw, bias, top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5)
    idx, wts = route_topk(x, gw, bias, 8, 8, 4, 2.5)
    # sigmoid's exp may differ by an ulp from torch's: ids may swap only on near-ties
    same = (idx == ref_idx).all(dim=1).float().mean().item()
    assert same >= 0.99, same
    rows = (idx == ref_idx).all(dim=1)
    torch.testing.assert_close(wts[rows], ref_w[rows], rtol=0, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs CUDA (sm80+) and triton")
def test_fused_norm_cuda_graph_replay():
    from fluxlab.engine.layers.rotary import PartialRotary
    from fluxlab.kernels.fused_norm import qk_norm_rope, rms_norm

    gen = torch.Generator().manual_seed(3)
    T, hq, hkv, d, rd = 32, 16, 4, 128, 64
    rope = PartialRotary(d, rd, 600000.0, max_positions=4096).cuda()
    x, gw, bias = _route_inputs(T, 2048, 256, gen, dtype=torch.bfloat16, device="cuda")
    w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, device="cuda").bfloat16()
    pos = torch.arange(T, device="cuda")

    def step():
        return (rms_norm(x, w, 1e-6), *qk_norm_rope(qkv, pos, w[:d], w[:d], 1e-6, rope.cos_cache, rope.sin_cache,
                                                     hq, hkv, d, rd), *route_topk(x, gw, bias, 8, 8, 4, 2.5))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()
    x.copy_(torch.randn_like(x)), qkv.copy_(torch.randn_like(qkv)), pos.copy_(pos + 100)
    g.replay()
    for a, b in zip(outs, step()):
        assert torch.equal(a, b)


def route_topk(x, gate_weight, expert_bias, top_k, n_group, topk_group, routed_scaling_factor, idx_dtype=torch.int64):
    """The fused routing as the model runs it: moe.route's router GEMM, then the one-launch top-k kernel."""
    from fluxlab.engine.layers.moe import router_logits
    from fluxlab.kernels.route_topk import route_topk_from_logits

    return route_topk_from_logits(router_logits(x, gate_weight), expert_bias, top_k, n_group, topk_group,
                                  routed_scaling_factor, idx_dtype)


if __name__ == "__main__":
    _interpreter_checks()
