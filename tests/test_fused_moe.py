"""fused_moe (Triton) and grouped_mm_moe against moe_reference / moe_forward.

CPU: the Triton kernels run under the interpreter (TRITON_INTERPRET=1) in a subprocess, so the env
var is set before triton decorates anything regardless of what this pytest process imported
already; fp32 inputs, fp32 tolerance. Skipped when triton is not installed.
GPU (`-m gpu`): bf16 on CUDA against moe_forward, and CUDA-graph capture/replay.
"""
import importlib.util

import pytest
import torch
from triton_helpers import run_interpreter_checks

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _routing(num_tokens, num_experts, top_k, gen):
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    return idx, torch.rand(num_tokens, top_k, generator=gen) + 0.05


def _interpreter_checks() -> None:
    """Runs in the TRITON_INTERPRET=1 subprocess."""
    from fluxlab.engine.layers.moe import moe_reference
    from fluxlab.kernels.fused_moe import fused_moe
    from fluxlab.kernels.moe_config import MoEConfig

    gen = torch.Generator().manual_seed(0)
    small = MoEConfig(BLOCK_M=32, BLOCK_N1=32, BLOCK_K1=32, BLOCK_N2=16, BLOCK_K2=32, GROUP_M=2)
    cases = [  # (E, H, I, K, T, config, topk dtype)
        (8, 64, 32, 2, 1, None, torch.int64),
        (8, 64, 32, 2, 5, None, torch.int32),
        (8, 64, 32, 2, 33, None, torch.int64),
        (8, 64, 32, 2, 33, small, torch.int64),
        (16, 80, 48, 4, 33, small, torch.int64),   # H, I not multiples of BLOCK_K: masked K tails
        (16, 80, 48, 4, 7, MoEConfig(BLOCK_M=64, BLOCK_N1=16, BLOCK_K1=16, BLOCK_N2=16, BLOCK_K2=16, GROUP_M=1),
         torch.int64),
    ]
    for num_experts, hidden, inter, top_k, num_tokens, cfg, idx_dtype in cases:
        x = torch.randn(num_tokens, hidden, generator=gen)
        w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
        w_down = torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5
        idx, wts = _routing(num_tokens, num_experts, top_k, gen)
        ref = moe_reference(x, idx, wts, w_gate_up, w_down)
        out = fused_moe(x, idx.to(idx_dtype), wts, w_gate_up, w_down, config=cfg)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        err = (out - ref).abs().max().item()
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), (num_experts, hidden, inter, top_k, num_tokens, cfg, err)

    # Expert parallel: ids == E mark slots that live on another rank; they contribute nothing.
    num_experts, hidden, inter, top_k, num_tokens = 8, 64, 32, 4, 9
    x = torch.randn(num_tokens, hidden, generator=gen)
    w_gate_up = torch.randn(2 * num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w_down = torch.randn(2 * num_experts, hidden, inter, generator=gen) * inter ** -0.5
    idx, wts = _routing(num_tokens, 2 * num_experts, top_k, gen)   # over both ranks' experts
    mine = idx < num_experts                                         # this rank holds experts 0..7
    local = torch.where(mine, idx, num_experts)
    ref = moe_reference(x, torch.where(mine, idx, 0), torch.where(mine, wts, 0.0),
                        w_gate_up[:num_experts], w_down[:num_experts])
    out = fused_moe(x, local, wts, w_gate_up[:num_experts], w_down[:num_experts], config=small,
                    foreign_slots=True)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), (out - ref).abs().max().item()

    _check_combine_adds_with_torch_roundings(gen)
    _check_align(gen)
    _check_counting_sort_align_gives_the_scan_align_outputs_bit_for_bit(gen)
    _check_shrunk_row_tiles_give_the_full_tiles_values(gen)
    _check_tma_weight_tiles_match_the_reference(gen)
    print("interpreter checks ok")


def _check_combine_adds_with_torch_roundings(gen) -> None:
    """The combine pass (slot sum, then the shared expert and the residual added) equals torch's
    `(sum.to(bf16) + shared) + residual` bit for bit. Slot values are multiples of 2**-6 below 4, so
    their fp32 sum is exact in any order and only the roundings are under test."""
    from fluxlab.kernels.fused_moe import combine_slots, fused_moe
    from fluxlab.kernels.moe_config import MoEConfig

    num_tokens, top_k, hidden = 6, 4, 1100  # hidden past one 1024-column block: the masked tail
    for dt in (torch.bfloat16, torch.float32):
        slots = (torch.randint(-256, 256, (num_tokens * top_k, hidden), generator=gen) / 64).to(dt)
        shared = torch.randn(num_tokens, hidden, generator=gen).to(dt)
        residual = (torch.randn(num_tokens, hidden, generator=gen) * 8).to(dt)
        summed = slots.view(num_tokens, top_k, hidden).float().sum(dim=1).to(dt)
        assert torch.equal(combine_slots(slots, top_k), summed)
        assert torch.equal(combine_slots(slots, top_k, (shared,)), summed + shared)
        want = (summed + shared) + residual
        got = combine_slots(slots, top_k, (shared, residual))
        assert got.dtype == dt and torch.equal(got, want), (dt, (got.float() - want.float()).abs().max())
        assert not torch.equal(combine_slots(slots, top_k, (residual, shared)), want) or dt == torch.float32
        # shared_last: the last slot holds the shared expert (FP8's fused shared expert), added as shared was
        with_shared = torch.cat([slots.view(num_tokens, top_k, hidden), shared[:, None]], 1).view(-1, hidden)
        got = combine_slots(with_shared, top_k + 1, (residual,), shared_last=True)
        assert torch.equal(got, want), (dt, (got.float() - want.float()).abs().max())
        assert not torch.equal(combine_slots(with_shared, top_k + 1, (residual,)), want) or dt == torch.float32
    # through fused_moe: the adds land on the MoE output as torch would add them
    num_experts, hidden, inter, top_k, num_tokens = 8, 64, 32, 2, 5
    x = torch.randn(num_tokens, hidden, generator=gen)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w_down = torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5
    idx, wts = _routing(num_tokens, num_experts, top_k, gen)
    cfg = MoEConfig(BLOCK_M=16, BLOCK_N1=32, BLOCK_K1=32, BLOCK_N2=32, BLOCK_K2=32)
    plain = fused_moe(x, idx, wts, w_gate_up, w_down, config=cfg)
    a, b = torch.randn(num_tokens, hidden, generator=gen), torch.randn(num_tokens, hidden, generator=gen)
    assert torch.equal(fused_moe(x, idx, wts, w_gate_up, w_down, config=cfg, adds=(a, b)), (plain + a) + b)
    try:
        fused_moe(x, idx, wts, w_gate_up, w_down, config=cfg, adds=(a, a, a))
        raise AssertionError("three addends were accepted")
    except ValueError as err:
        assert "at most two" in str(err)


def _assert_aligned(idx, num_experts, bm, aligned):
    """The layout the GEMMs rely on: every placed slot once, runs sorted by expert, stable."""
    sorted_ids, expert_ids, total = aligned
    flat = idx.reshape(-1)
    n = flat.numel()
    placed = (flat >= 0) & (flat < num_experts)
    counts = torch.bincount(flat[placed], minlength=num_experts)
    assert int(total) == int(((counts + bm - 1) // bm * bm).sum())
    sorted_ids, expert_ids = sorted_ids[:int(total)], expert_ids[:int(total) // bm]
    valid = sorted_ids[sorted_ids < n]
    assert sorted(valid.tolist()) == torch.nonzero(placed).flatten().tolist()
    assert (sorted_ids[sorted_ids >= n] == n).all()
    prev_expert = -1
    for b in range(expert_ids.numel()):
        block = sorted_ids[b * bm:(b + 1) * bm]
        block = block[block < n].long()
        assert block.numel() > 0 and (flat[block] == expert_ids[b]).all()
        assert int(expert_ids[b]) >= prev_expert and (block.diff() > 0).all()   # sorted, stable
        prev_expert = int(expert_ids[b])


def _align_cases(gen):
    """(idx, E): several token counts and routings, empty experts, one expert for everything,
    foreign ids (== E), nothing placed."""
    cases = []
    for num_tokens, num_experts, top_k in ((1, 8, 2), (5, 8, 2), (33, 16, 4), (90, 64, 4), (20, 256, 8)):
        cases.append((_routing(num_tokens, num_experts, top_k, gen)[0], num_experts))
    cases.append((_routing(60, 32, 4, gen)[0] * 2, 64))                       # odd experts empty
    cases.append((torch.full((40, 1), 3, dtype=torch.int64), 8))               # all on one expert
    cases.append((torch.randint(0, 9, (30, 2), generator=gen), 8))            # id 8: foreign slots
    cases.append((torch.full((9, 2), 8, dtype=torch.int64), 8))               # nothing placed
    return cases


def _chunks(num_slots):
    """Chunk sizes to run: one program where the interpreter's tl.sort is quick enough (it is
    ~1 s per 256 keys), and always several chunks of 32 slots (the multi-chunk path)."""
    return (None, 32) if num_slots <= 128 else (32,)


def _check_align(gen):
    from fluxlab.kernels.moe_align import moe_align

    for idx, num_experts in _align_cases(gen):
        for bm in (16, 64):
            for chunk in _chunks(idx.numel()):
                _assert_aligned(idx, num_experts, bm, moe_align(idx, num_experts, bm, chunk=chunk))


def _check_counting_sort_align_gives_the_scan_align_outputs_bit_for_bit(gen):
    """The counting sort keeps each expert's slots in their original order, as the scan did, so
    the rows, and every output value, are the previous kernel's."""
    import functools

    from fluxlab.engine.layers.moe import moe_reference
    from fluxlab.kernels.fused_moe import fused_moe
    from fluxlab.kernels.moe_config import MoEConfig
    from fluxlab.kernels.moe_align import moe_align, moe_align_scan

    cfg = MoEConfig(BLOCK_M=16, BLOCK_N1=32, BLOCK_K1=32, BLOCK_N2=32, BLOCK_K2=32, GROUP_M=2)
    hidden, inter = 64, 32
    for idx, num_experts in _align_cases(gen):
        old = moe_align_scan(idx, num_experts, 32)
        total = int(old[2])
        for chunk in _chunks(idx.numel()):
            new = moe_align(idx, num_experts, 32, chunk=chunk)
            assert int(new[2]) == total
            assert torch.equal(new[0][:total], old[0][:total]) and torch.equal(new[1][:total // 32], old[1][:total // 32])
        if num_experts > 64 or idx.numel() > 256:  # the interpreter's GEMMs: seconds per case
            continue
        num_tokens, top_k = idx.shape
        x = torch.randn(num_tokens, hidden, generator=gen)
        w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
        w_down = torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5
        wts = torch.rand(num_tokens, top_k, generator=gen)
        foreign = bool((idx >= num_experts).any())
        align = functools.partial(moe_align, chunk=_chunks(idx.numel())[0])
        new = fused_moe(x, idx, wts, w_gate_up, w_down, config=cfg, foreign_slots=foreign, align=align)
        old = fused_moe(x, idx, wts, w_gate_up, w_down, config=cfg, foreign_slots=foreign, align=moe_align_scan)
        assert torch.equal(new, old), (num_tokens, num_experts)
        mine = idx < num_experts
        ref = moe_reference(x, torch.where(mine, idx, 0), torch.where(mine, wts, 0.0), w_gate_up, w_down)
        assert torch.allclose(new, ref, rtol=1e-5, atol=1e-5), (new - ref).abs().max().item()


def _check_shrunk_row_tiles_give_the_full_tiles_values(gen):
    """SHRINK1/2: row tiles whose rows fit in half / a quarter of BLOCK_M run a GEMM of that height;
    every output equals the full-height kernel's and the reference's (masked K tails included)."""
    from fluxlab.engine.layers.moe import moe_reference
    from fluxlab.kernels.fused_moe import fused_moe
    from fluxlab.kernels.moe_config import MoEConfig

    for num_experts, hidden, inter, top_k, num_tokens in ((8, 64, 32, 2, 40), (4, 64, 32, 2, 150), (4, 80, 48, 2, 45)):
        x = torch.randn(num_tokens, hidden, generator=gen)
        w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
        w_down = torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5
        idx, wts = _routing(num_tokens, num_experts, top_k, gen)
        ref = moe_reference(x, idx, wts, w_gate_up, w_down)
        base = dict(BLOCK_M=64, BLOCK_N1=32, BLOCK_K1=32, BLOCK_N2=32, BLOCK_K2=32, GROUP_M=2)
        full = fused_moe(x, idx, wts, w_gate_up, w_down, config=MoEConfig(**base))
        assert torch.allclose(full, ref, rtol=1e-5, atol=1e-5), (full - ref).abs().max().item()
        for shrink1, shrink2 in ((1, 0), (0, 1), (2, 2)):
            out = fused_moe(x, idx, wts, w_gate_up, w_down, config=MoEConfig(**base, SHRINK1=shrink1, SHRINK2=shrink2))
            # The interpreter's tl.dot is numpy's matmul, whose summation order can follow the tile
            # height (triton 3.9 + numpy 2.4: 2.4e-7 apart at 40 tokens); equal bits are a property of
            # the GPU kernel, asserted by test_shrunk_row_tiles_give_the_full_height_bits_on_gpu.
            torch.testing.assert_close(out, full, rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"{(num_tokens, shrink1, shrink2)}: {m}")


def _check_tma_weight_tiles_match_the_reference(gen):
    """TMA1/TMA2: weight tiles through a tensor descriptor over [E*N, K], with N and K tails (the
    rows past an expert's N belong to the next expert, or are past the end: masked on store)."""
    from fluxlab.engine.layers.moe import moe_reference
    from fluxlab.kernels.fused_moe import fused_moe
    from fluxlab.kernels.moe_config import MoEConfig

    for num_experts, hidden, inter, top_k, num_tokens in ((4, 80, 48, 2, 45), (8, 64, 32, 2, 40)):
        x = torch.randn(num_tokens, hidden, generator=gen)
        w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
        w_down = torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5
        idx, wts = _routing(num_tokens, num_experts, top_k, gen)
        ref = moe_reference(x, idx, wts, w_gate_up, w_down)
        cfg = MoEConfig(BLOCK_M=32, BLOCK_N1=32, BLOCK_K1=32, BLOCK_N2=32, BLOCK_K2=32, GROUP_M=2, TMA1=1, TMA2=1,
                        SHRINK1=1)
        out = fused_moe(x, idx, wts, w_gate_up, w_down, config=cfg)
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), (out - ref).abs().max().item()
    strided = torch.randn(w_gate_up.shape[0], 2 * w_gate_up.shape[1], w_gate_up.shape[2], generator=gen)[:, ::2]
    try:
        fused_moe(x, idx, wts, strided, w_down, config=cfg)
    except ValueError as err:
        assert "TMA1/TMA2" in str(err) and "contiguous" in str(err)
    else:
        raise AssertionError("TMA over non-contiguous weights must be refused")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (the CPU check runs it under TRITON_INTERPRET=1)")
def test_fused_moe_matches_reference_interpreter():
    run_interpreter_checks(__file__)


def test_grouped_mm_moe_matches_moe_forward_cpu():
    from fluxlab.engine.layers.moe import moe_forward
    from fluxlab.kernels.fused_moe import grouped_mm_moe

    gen = torch.Generator().manual_seed(1)
    num_experts, hidden, inter, top_k, num_tokens = 8, 64, 32, 2, 17
    x = torch.randn(num_tokens, hidden, generator=gen)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.1
    w_down = torch.randn(num_experts, hidden, inter, generator=gen) * 0.1
    idx, wts = _routing(num_tokens, num_experts, top_k, gen)
    ref = moe_forward(x, idx, wts, w_gate_up, w_down, use_grouped_mm=False)
    out = grouped_mm_moe(x, idx, wts, w_gate_up, w_down)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_tuned_table_gives_the_config_of_the_nearest_tuned_token_count(tmp_path, monkeypatch):
    import json

    from fluxlab.kernels import moe_config as fm

    monkeypatch.setattr(fm, "CONFIG_DIR", tmp_path)
    shape = fm.shape_key(256, 2048, 512, 8, torch.bfloat16)
    table = {"configs": {shape: {"512": {"BLOCK_M": 32, "BLOCK_N1": 128, "ms": 0.4},
                                 "2048": {"BLOCK_M": 64, "WARPS2": 8, "ms": 0.5}}}}
    fm.device_table_path("Test GPU (tuned)").write_text(json.dumps(table))
    assert fm.device_table_path("Test GPU (tuned)").name == "Test_GPU_tuned.json"
    assert fm.tuned_config(600, shape, "Test GPU (tuned)") == fm.MoEConfig(BLOCK_M=32, BLOCK_N1=128)
    assert fm.tuned_config(1500, shape, "Test GPU (tuned)") == fm.MoEConfig(BLOCK_M=64, WARPS2=8)  # log2 nearer 2048
    assert fm.tuned_config(9000, shape, "Test GPU (tuned)").BLOCK_M == 64
    assert fm.tuned_config(512, fm.shape_key(128, 2048, 512, 8, torch.bfloat16), "Test GPU (tuned)") is None
    assert fm.tuned_config(512, shape, "Untuned GPU") is None


def test_a_shrink_below_sixteen_rows_is_refused_naming_the_key():
    from fluxlab.kernels.moe_config import MoEConfig

    assert MoEConfig(BLOCK_M=64, SHRINK1=2).SHRINK1 == 2
    with pytest.raises(ValueError, match="SHRINK2=1 with BLOCK_M=16"):
        MoEConfig(BLOCK_M=16, SHRINK2=1)
    with pytest.raises(ValueError, match="SHRINK1=3"):
        MoEConfig(BLOCK_M=128, SHRINK1=3)


def test_shipped_tables_hold_only_valid_configs():
    import dataclasses
    import json

    from fluxlab.kernels.moe_config import CONFIG_DIR, MoEConfig

    fields = {f.name for f in dataclasses.fields(MoEConfig)}
    for path in CONFIG_DIR.glob("*.json"):
        for shape, entries in json.loads(path.read_text())["configs"].items():
            for tokens, entry in entries.items():
                cfg = MoEConfig(**{k: v for k, v in entry.items() if k in fields})
                assert int(tokens) > 0 and cfg.BLOCK_M in (16, 32, 64, 128), (path.name, shape, tokens)


# ---------------------------------------------------------------------------------------------- GPU

def _gpu_case(hidden, inter, num_tokens, num_experts=256, top_k=8, seed=0):
    from fluxlab.engine.layers.moe import route

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, device=dev, dtype=bf, generator=gen) * hidden ** -0.5
    w_down = torch.randn(num_experts, hidden, inter, device=dev, dtype=bf, generator=gen) * inter ** -0.5
    gate_w = torch.randn(num_experts, hidden, device=dev, dtype=bf, generator=gen) * hidden ** -0.5
    bias = torch.randn(num_experts, device=dev, generator=gen) * 0.01
    x = torch.randn(num_tokens, hidden, device=dev, dtype=bf, generator=gen)
    idx, wts = route(x, gate_w, bias, top_k=top_k, n_group=8, topk_group=4, routed_scaling_factor=2.5)
    return x, idx, wts, w_gate_up, w_down


def _gpu_ok():
    return HAVE_TRITON and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs CUDA (sm80+) and triton")
@pytest.mark.parametrize("num_tokens", [1, 32, 257, 2048])
def test_fused_moe_bf16_matches_moe_forward(num_tokens):
    from fluxlab.engine.layers.moe import moe_forward, moe_reference
    from fluxlab.kernels.fused_moe import fused_moe, grouped_mm_moe

    x, idx, wts, w_gate_up, w_down = _gpu_case(2048, 512, num_tokens)
    ref = (moe_forward(x, idx, wts, w_gate_up, w_down) if num_tokens > 64
           else moe_reference(x, idx, wts, w_gate_up, w_down))
    out = fused_moe(x, idx, wts, w_gate_up, w_down)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    tol = 2e-2 * max(1.0, ref.float().abs().max().item())
    assert (out.float() - ref.float()).abs().max().item() <= tol
    if torch.cuda.get_device_capability()[0] >= 9:
        out2 = grouped_mm_moe(x, idx, wts, w_gate_up, w_down)
        assert (out2.float() - ref.float()).abs().max().item() <= tol


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs CUDA (sm80+) and triton")
@pytest.mark.parametrize("num_tokens", [32, 4096])
def test_combine_pass_equals_torchs_sum_cast_and_adds_on_gpu(num_tokens):
    """The combine pass against what the layer ran before it: torch.sum(..., dtype=fp32).to(bf16), then the
    shared expert's and the residual's bf16 adds. The fp32 sums of 8 slots may be reduced in another order,
    so a bf16 result may differ by one ulp in rare elements; none by more."""
    from fluxlab.kernels.fused_moe import combine_slots

    gen = torch.Generator(device="cuda").manual_seed(3)
    top_k, hidden, bf = 8, 2048, torch.bfloat16
    slots = torch.randn(num_tokens * top_k, hidden, device="cuda", generator=gen).to(bf) * 0.3
    shared = torch.randn(num_tokens, hidden, device="cuda", generator=gen).to(bf)
    residual = torch.randn(num_tokens, hidden, device="cuda", generator=gen).to(bf) * 4
    want = (torch.sum(slots.view(num_tokens, top_k, hidden), dim=1, dtype=torch.float32).to(bf) + shared) + residual
    got = combine_slots(slots, top_k, (shared, residual))
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert ulps.max().item() <= 1 and ulps.float().mean().item() < 1e-3, (ulps.max().item(), ulps.float().mean().item())


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs CUDA (sm80+) and triton")
@pytest.mark.parametrize("num_tokens", [32, 2048])   # one align program; several chunks
def test_fused_moe_cuda_graph_replay_tracks_new_routing(num_tokens):
    from fluxlab.kernels.fused_moe import fused_moe

    x, idx, wts, w_gate_up, w_down = _gpu_case(2048, 512, num_tokens)
    eager = fused_moe(x, idx, wts, w_gate_up, w_down)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(x, idx, wts, w_gate_up, w_down)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, idx, wts, w_gate_up, w_down)
    graph.replay()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    # new routing / inputs written in place: the replay must follow (no baked-in counts)
    x2, idx2, wts2, _, _ = _gpu_case(2048, 512, num_tokens, seed=1)
    x.copy_(x2), idx.copy_(idx2), wts.copy_(wts2)
    graph.replay()
    torch.testing.assert_close(out, fused_moe(x, idx, wts, w_gate_up, w_down), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs CUDA (sm80+) and triton")
@pytest.mark.parametrize("num_tokens", [1, 256, 257, 4096])   # one program up to 2048 slots, then chunks
def test_counting_sort_align_gives_the_scan_align_rows_on_gpu(num_tokens):
    from fluxlab.kernels.moe_align import moe_align, moe_align_scan

    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    routings = [torch.randint(0, 256, (num_tokens, 8), device="cuda", generator=gen),   # repeats allowed
                torch.randint(0, 257, (num_tokens, 8), device="cuda", generator=gen),   # 256: foreign slots
                torch.full((num_tokens, 8), 7, device="cuda"),                           # one expert
                _gpu_case(2048, 512, num_tokens)[1]]                                     # the router's
    for idx in routings:
        for bm in (16, 128):
            new, old = moe_align(idx, 256, bm), moe_align_scan(idx, 256, bm)
            total = int(old[2])
            assert int(new[2]) == total
            assert torch.equal(new[0][:total], old[0][:total]) and torch.equal(new[1][:total // bm], old[1][:total // bm])


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs CUDA (sm80+) and triton")
@pytest.mark.parametrize("num_tokens", [512, 2048, 4096])
def test_shrunk_row_tiles_give_the_full_height_bits_on_gpu(num_tokens):
    import dataclasses

    from fluxlab.engine.layers.moe import moe_forward
    from fluxlab.kernels.fused_moe import fused_moe
    from fluxlab.kernels.moe_config import MoEConfig, default_config
    from fluxlab.kernels.moe_align import moe_align_scan

    x, idx, wts, w_gate_up, w_down = _gpu_case(2048, 512, num_tokens)
    ref = moe_forward(x, idx, wts, w_gate_up, w_down).float()
    tol = 2e-2 * max(1.0, ref.abs().max().item())
    table = default_config(num_tokens, 8, 256, 2048, 512, torch.bfloat16, x.device)
    previous = fused_moe(x, idx, wts, w_gate_up, w_down, config=dataclasses.replace(table, SHRINK1=0, SHRINK2=0),
                         align=moe_align_scan)
    if not (table.SHRINK1 or table.SHRINK2):   # the counting-sort align alone changes no value
        assert torch.equal(fused_moe(x, idx, wts, w_gate_up, w_down, config=table), previous)
    shrinks = {(128, 1, 1)} | ({(table.BLOCK_M, table.SHRINK1 or 1, table.SHRINK2 or 1)} if table.BLOCK_M >= 32 else set())
    for bm, shrink1, shrink2 in sorted(shrinks):
        stages = {} if bm == table.BLOCK_M else {"STAGES1": min(3, table.STAGES1), "STAGES2": min(3, table.STAGES2)}
        full = MoEConfig(**{**dataclasses.asdict(table), "BLOCK_M": bm, "SHRINK1": 0, "SHRINK2": 0, **stages})
        want = fused_moe(x, idx, wts, w_gate_up, w_down, config=full)
        assert (want.float() - ref).abs().max().item() <= tol
        got = fused_moe(x, idx, wts, w_gate_up, w_down,
                        config=dataclasses.replace(full, SHRINK1=shrink1, SHRINK2=shrink2))
        assert torch.equal(got, want), (bm, shrink1, shrink2, (got.float() - want.float()).abs().max().item())
    if torch.cuda.get_device_capability()[0] >= 9:   # weight tiles through TMA: same values within bf16 tolerance
        got = fused_moe(x, idx, wts, w_gate_up, w_down, config=dataclasses.replace(table, TMA1=1, TMA2=1))
        assert (got.float() - ref).abs().max().item() <= tol


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs CUDA (sm80+) and triton")
@pytest.mark.parametrize("tuned_for", [2048, 4096, None])   # the shipped table's configs; BM 128 + SHRINK 1
def test_a_tokens_output_does_not_depend_on_the_other_tokens_in_the_batch(tuned_for):
    from fluxlab.bench.moe_layer import probe_batches
    from fluxlab.kernels.fused_moe import fused_moe
    from fluxlab.kernels.moe_config import MoEConfig, default_config

    _, _, _, w_gate_up, w_down = _gpu_case(2048, 512, 1)
    batches = probe_batches(2048)
    cfg = (default_config(tuned_for, 8, 256, 2048, 512, torch.bfloat16, w_gate_up.device) if tuned_for else
           MoEConfig(BLOCK_M=128, BLOCK_N1=128, BLOCK_K1=64, WARPS1=8, BLOCK_N2=128, BLOCK_K2=64, WARPS2=8,
                     SHRINK1=1, SHRINK2=1))
    outs = [fused_moe(x, idx, wts, w_gate_up, w_down, config=cfg)[rows] for x, idx, wts, rows in batches]
    for out in outs[1:]:
        assert torch.equal(out, outs[0]), (cfg, (out.float() - outs[0].float()).abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_router_logits_in_bf16_are_the_fp32_gemm_of_the_upcast_operands():
    """Products of bf16 numbers are exact in fp32: the bf16 GEMM with fp32 output differs from the
    fp32 GEMM only in how the tensor cores accumulate, far below bf16 resolution (H200, torch 2.11:
    2.1e-6 relative to fp64 against the fp32 GEMM's 1.7e-7; bf16's step is 4e-3)."""
    from fluxlab.engine.layers.moe import mm_fp32_out_works, router_logits

    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16, generator=gen) * 2048 ** -0.5
    assert mm_fp32_out_works(x.device), "torch.mm(out_dtype=float32) is the router's GPU path"
    got = router_logits(x, w)
    want = (x.double() @ w.double().t())
    assert got.dtype == torch.float32
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-5
    fp32 = torch.nn.functional.linear(x.float(), w.float())
    assert ((fp32.double() - want).norm() / want.norm()).item() < 1e-6  # the path it replaces
    # the experts chosen from these logits are the fp32 GEMM's (up to rare near-ties)
    same = (got.topk(8).indices.sort().values == fp32.topk(8).indices.sort().values).all(dim=1)
    assert same.float().mean().item() >= 0.99


if __name__ == "__main__":
    _interpreter_checks()

