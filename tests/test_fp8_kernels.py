"""Block-scaled FP8 (fluxlab/engine/layers/fp8.py, kernels/fp8_gemm.py, kernels/fp8_moe.py).

CPU: the quantizers' layout and error bounds in this process; the Triton kernels under the
interpreter (TRITON_INTERPRET=1) in a subprocess against the dequantize -> matmul reference, fp32
activations (the interpreter's bf16 stores do not round as torch does).
GPU (`-m gpu`): bf16 on CUDA against the reference, bit-equal rows whatever the batch, graph replay.
"""
import importlib.util

import pytest
import torch
from triton_helpers import run_interpreter_checks

from fluxlab.engine.layers.fp8 import (BLOCK, FP8_DTYPE, FP8_MAX, dequantize_blocks, dequantize_blocks_rows, dequantize_stacked,
                                       fp8_linear_reference, fp8_moe_reference, quantize_blocks, quantize_stacked,
                                       quantize_token_groups)

HAVE_TRITON = importlib.util.find_spec("triton") is not None
E4M3_HALF_STEP = 2.0 ** -4   # 3 mantissa bits: rounding moves a normal value by at most 1/16 of it
E4M3_SUBNORMAL_STEP = 2.0 ** -9


def test_weight_scale_inv_has_a_scale_per_128_by_128_block():
    q, s = quantize_blocks(torch.randn(300, 200))
    assert q.dtype == FP8_DTYPE and q.shape == (300, 200)
    assert s.dtype == torch.float32 and s.shape == (3, 2)
    q, s = quantize_blocks(torch.randn(4, 256, 128))   # stacked experts: one grid per expert
    assert s.shape == (4, 2, 1)


def test_block_quantize_round_trip_is_within_half_an_e4m3_step():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 260, generator=gen) * torch.logspace(-3, 1, 260)[None, :]
    w[:128, :128] = 0.0                                 # an all-zero block stays zero
    q, s = quantize_blocks(w)
    back = dequantize_blocks(q, s)
    scale = s.repeat_interleave(BLOCK, 0)[:300].repeat_interleave(BLOCK, 1)[:, :260]
    bound = torch.maximum(E4M3_HALF_STEP * w.abs(), E4M3_SUBNORMAL_STEP / 2 * scale) * (1 + 1e-6)
    assert ((back - w).abs() <= bound).all()
    assert (back[:128, :128] == 0).all()
    # each block's largest magnitude lands on e4m3's largest finite value
    assert q.float().abs().amax().item() == FP8_MAX
    assert torch.equal(quantize_blocks(back)[0].float(), q.float())   # quantizing the dequantized is idempotent


def test_stacked_gate_and_up_never_share_a_scale_block():
    gen = torch.Generator().manual_seed(1)
    gate = torch.randn(3, 40, 200, generator=gen) * 1e-3   # I = 40 < 128: one block would mix both
    up = torch.randn(3, 40, 200, generator=gen) * 10
    q, s = quantize_stacked(torch.cat([gate, up], dim=1), 2)
    assert s.shape == (3, 2, 2)
    back = dequantize_stacked(q, s, 2)
    # one grid over both would give the gate up's scale (10 / 448 a step of ~2e-3): most gate values would be 0
    assert ((back[:, :40] - gate).norm() / gate.norm()).item() < 0.05


def test_activation_groups_are_quantized_per_token_and_128_columns():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 300, generator=gen)
    x[2] *= 1000
    x[3, 128:256] = 0.0
    q, s = quantize_token_groups(x)
    assert q.shape == x.shape and s.shape == (5, 3)
    torch.testing.assert_close(s[:, 0], x[:, :128].abs().amax(1) / FP8_MAX, rtol=1e-7, atol=0)
    assert s[3, 1].item() == pytest.approx(1e-10 / FP8_MAX) and (q[3, 128:256].float() == 0).all()
    back = q.float() * s.repeat_interleave(BLOCK, 1)[:, :300]
    assert ((back - x).abs() <= E4M3_HALF_STEP * x.abs() + E4M3_SUBNORMAL_STEP * s.repeat_interleave(BLOCK, 1)[:, :300]).all()


def test_fp8_linear_stays_within_a_few_percent_of_the_full_precision_product():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 512, generator=gen).bfloat16()
    w = torch.randn(384, 512, generator=gen) * 512 ** -0.5
    q, s = quantize_blocks(w)
    y = fp8_linear_reference(x, q, s)
    assert y.dtype == torch.bfloat16 and y.shape == (16, 384)
    exact = x.float() @ w.t()
    assert ((y.float() - exact).norm() / exact.norm()).item() < 0.05


def test_fp8_moe_reference_matches_the_bf16_moe_up_to_fp8_rounding():
    from fluxlab.engine.layers.moe import moe_reference

    gen = torch.Generator().manual_seed(4)
    E, H, I, K, T = 8, 256, 128, 2, 12
    x = torch.randn(T, H, generator=gen)
    w_gate_up = torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5
    w_down = torch.randn(E, H, I, generator=gen) * I ** -0.5
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    wts = torch.rand(T, K, generator=gen) + 0.05
    ref = moe_reference(x, idx, wts, w_gate_up, w_down)
    got = fp8_moe_reference(x, idx, wts, *quantize_stacked(w_gate_up, 2), *quantize_blocks(w_down))
    assert ((got - ref).norm() / ref.norm()).item() < 0.08   # two chained e4m3 GEMMs on random data: ~6%


def test_a_shared_expert_in_the_last_slot_is_added_after_the_rounded_routed_sum():
    """shared_last: the stack's last expert, weight 1 in every token's last slot, is the routed sum
    (rounded) plus that expert alone, as the separate shared expert was added (`adds[0]`)."""
    gen = torch.Generator().manual_seed(5)
    E, H, I, K, T = 6, 256, 128, 2, 9
    x, idx, wts, wgu, sgu, wd, sd = _moe_case(E + 1, H, I, K, T, gen, dtype=torch.bfloat16)
    idx = idx % E   # routed ids never pick the shared expert
    residual = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    last = torch.full((T, 1), E)
    got = fp8_moe_reference(x, torch.cat([idx, last], 1), torch.cat([wts, torch.ones(T, 1)], 1), wgu, sgu, wd, sd,
                            adds=(residual,), shared_last=True)
    routed = fp8_moe_reference(x, idx, wts, wgu[:E], sgu[:E], wd[:E], sd[:E])
    shared = fp8_moe_reference(x, torch.zeros(T, 1, dtype=torch.long), torch.ones(T, 1), wgu[E:], sgu[E:], wd[E:],
                               sd[E:])
    assert torch.equal(got, (routed + shared) + residual)
    assert not torch.equal(got, fp8_moe_reference(x, torch.cat([idx, last], 1), torch.cat([wts, torch.ones(T, 1)], 1),
                                                  wgu, sgu, wd, sd, adds=(residual,)))   # the order is seen


# ------------------------------------------------------------------------------- the Triton kernels

def _moe_case(E, H, I, K, T, gen, device="cpu", dtype=torch.float32):
    x = torch.randn(T, H, generator=gen).to(device, dtype)
    wgu, sgu = quantize_stacked(torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5, 2)
    wd, sd = quantize_blocks(torch.randn(E, H, I, generator=gen) * I ** -0.5)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    wts = torch.rand(T, K, generator=gen) + 0.05
    return x, idx.to(device), wts.to(device), wgu.to(device), sgu.to(device), wd.to(device), sd.to(device)


def _interpreter_checks() -> None:
    """Runs in the TRITON_INTERPRET=1 subprocess."""
    from fluxlab.kernels.fp8_gemm import fp8_matmul, quantize_act
    from fluxlab.kernels.fp8_moe import FP8MoEConfig, fp8_fused_moe

    gen = torch.Generator().manual_seed(0)
    for m, n, k in [(1, 64, 100), (5, 200, 300), (70, 128, 256)]:   # K tails, N tails, rows past one tile
        x = torch.randn(m, k, generator=gen) * 3
        q, s = quantize_blocks(torch.randn(n, k, generator=gen) * 0.05)
        got, want = fp8_matmul(x, q, s), fp8_linear_reference(x, q, s)
        assert ((got - want).norm() / want.norm()).item() < 1e-5, (m, n, k)
    # the in-kernel activation quantizer rounds as torch's cast: values just below a binade's top
    x = torch.tensor([[31.9] + [1.0] * 127, [447.0, -0.3] + [0.0] * 126, [0.0] * 128])
    for got, want in zip(quantize_act(torch.cat([x, x * 1e-3], 1)), quantize_token_groups(torch.cat([x, x * 1e-3], 1))):
        assert torch.equal(got.float(), want.float())
    x = torch.randn(9, 300, generator=gen) * torch.logspace(-4, 2, 300)
    for got, want in zip(quantize_act(x), quantize_token_groups(x)):
        assert torch.equal(got.float(), want.float())

    small = FP8MoEConfig(BLOCK_M=16, BLOCK_N2=64, GROUP_M=2)
    for E, H, I, K, T, cfg in [(8, 256, 128, 2, 5, None), (8, 200, 72, 2, 9, small),
                               (4, 128, 256, 3, 33, FP8MoEConfig(BLOCK_M=32, BLOCK_N2=32))]:
        x, idx, wts, wgu, sgu, wd, sd = _moe_case(E, H, I, K, T, gen)
        got = fp8_fused_moe(x, idx, wts, wgu, sgu, wd, sd, config=cfg)
        want = fp8_moe_reference(x, idx, wts, wgu, sgu, wd, sd)
        assert ((got - want).norm() / want.norm()).item() < 1e-5, (E, H, I, K, T)
        a, b = torch.randn_like(x), torch.randn_like(x)
        torch.testing.assert_close(fp8_fused_moe(x, idx, wts, wgu, sgu, wd, sd, config=cfg, adds=(a, b)),
                                   (got + a) + b, rtol=0, atol=0)
    # gelu-tanh (Diffusion-Gemma's experts): I of one and a half groups, so the intermediate's last
    # group is half masked and the up half's scales start one grid row in
    for E, H, I, K, T in [(4, 200, 192, 2, 11), (8, 256, 72, 3, 6)]:
        x, idx, wts, wgu, sgu, wd, sd = _moe_case(E, H, I, K, T, gen)
        x = x * 4   # gelu's curved part (silu and gelu-tanh part there by ~10%)
        got = fp8_fused_moe(x, idx, wts, wgu, sgu, wd, sd, config=small, activation="gelu_tanh")
        want = fp8_moe_reference(x, idx, wts, wgu, sgu, wd, sd, activation="gelu_tanh")
        assert ((got - want).norm() / want.norm()).item() < 1e-5, (E, H, I, K, T)
        silu = fp8_moe_reference(x, idx, wts, wgu, sgu, wd, sd)
        assert ((silu - want).norm() / want.norm()).item() > 1e-2   # the check can tell the two apart
    # several weights of one input (q/k/v): one shared activation quantization, separate calls' numbers
    from fluxlab.engine.layers.fp8 import fp8_linears

    x = torch.randn(6, 200, generator=gen)
    weights = [quantize_blocks(torch.randn(n, 200, generator=gen) * 0.05) for n in (192, 64, 64)]
    for got, (q, s) in zip(fp8_linears(x, weights), weights):
        assert torch.equal(got, fp8_matmul(x, q, s))
    # a shared expert stacked last and routed as every token's last slot (`shared_last`)
    x, idx, wts, wgu, sgu, wd, sd = _moe_case(5, 128, 128, 2, 13, gen)
    idx, wts = torch.cat([idx % 4, torch.full((13, 1), 4)], 1), torch.cat([wts, torch.ones(13, 1)], 1)
    residual = torch.randn_like(x)
    got = fp8_fused_moe(x, idx, wts, wgu, sgu, wd, sd, config=small, adds=(residual,), shared_last=True)
    want = fp8_moe_reference(x, idx, wts, wgu, sgu, wd, sd, adds=(residual,), shared_last=True)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    # expert parallel: ids == E are slots of another rank and add nothing
    x, idx, wts, wgu, sgu, wd, sd = _moe_case(8, 128, 128, 2, 7, gen)
    foreign = torch.where(idx < 4, idx, 4)
    got = fp8_fused_moe(x, foreign, wts, wgu[:4], sgu[:4], wd[:4], sd[:4], config=small, foreign_slots=True)
    want = fp8_moe_reference(x, foreign, wts, wgu[:4], sgu[:4], wd[:4], sd[:4])
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    # TMA tiles (descriptor loads, which the interpreter runs too) inside graph_tiles(): the pointer loads' bits,
    # with M below the 64-row tile, K a 16- but not a 128-multiple, several tiles; outside, pointer loads
    from fluxlab.kernels import tma

    real, asked, programs = tma.fits, [], tma.programs
    tma.fits = lambda *tensors: asked.append(1) or True   # the CPU has no TMA: take the path regardless
    tma.programs = lambda device, tiles: min(tiles, 2)   # no SMs to count: two programs walk the tiles
    try:
        for m, n, k in [(1, 64, 128), (5, 256, 272), (70, 192, 640)]:
            x = torch.randn(m, k, generator=gen)
            q, s = quantize_blocks(torch.randn(n, k, generator=gen) * 0.05)
            pointers = fp8_matmul(x, q, s)
            assert not asked
            with tma.graph_tiles():
                assert torch.equal(fp8_matmul(x, q, s), pointers), (m, n, k)
                assert torch.equal(fp8_matmul(x, q, s, tiles=(64, 128, 4, 3, 1)), pointers), (m, n, k)  # NARROW_TILES
                # a persistent launch (tma.persistent: from 1024 rows on a GPU): the same tiles, the same bits
                assert torch.equal(fp8_matmul(x, q, s, tiles=(64, 64, 4, 4, 1, True)), pointers), (m, n, k)
            assert asked == [1, 1, 1]
            asked.clear()
    finally:
        tma.fits, tma.programs = real, programs
    print("interpreter checks ok")


def test_fp8_tiles_follow_rows_and_weight_shape_on_64_row_tiles():
    """The GEMM's tile: the per-shape tile below WIDE_ROWS (Diffusion-Gemma's fused q/k/v), the wide one from there
    for every shape, the default otherwise; all 64 rows high (the one wgmma path whose bits the sweeps checked)."""
    from fluxlab.kernels import fp8_gemm

    assert fp8_gemm.tile_for(256, 8192, 2816) == (64, 128, 4, 3)
    assert fp8_gemm.tile_for(1023, 9216, 2816) == (64, 128, 4, 3)
    assert fp8_gemm.tile_for(1024, 8192, 2816) == fp8_gemm.tile_for(4096, 2048, 2048) == (64, 128, 4, 3)
    assert fp8_gemm.tile_for(32, 3072, 2048) == (64, 64, 4, 4)
    tiles = [fp8_gemm.tile_for(m, n, k) for m in (1, 1024) for n, k in [*fp8_gemm.NARROW_TILES, (2048, 2048)]]
    assert all(block_m == 64 for block_m, *_ in tiles), tiles


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_fp8_kernels_match_the_dequantize_matmul_reference_under_the_triton_interpreter():
    run_interpreter_checks(__file__)


# ------------------------------------------------------------------------------- GPU

def _gpu_ok() -> bool:
    return HAVE_TRITON and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs CUDA sm90+ and triton")
@pytest.mark.parametrize("m,n,k", [(1, 4096, 2048), (2048, 2048, 4096), (37, 300, 200)])
def test_fp8_matmul_on_gpu_matches_the_reference(m, n, k):
    from fluxlab.kernels.fp8_gemm import fp8_matmul, quantize_act

    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).bfloat16()
    (q_gpu, s_gpu), (q_cpu, s_cpu) = quantize_act(x.cuda()), quantize_token_groups(x)
    assert torch.equal(s_gpu.cpu(), s_cpu)   # the same scales
    # The codes: H200 run of 2026-12-03 found rare codes one e4m3 step from torch's CPU cast (not yet
    # explained: Triton's fp32 -> e4m3 conversion path on sm90 is the suspect); bound what was seen.
    differ = q_gpu.cpu().float() != q_cpu.float()
    assert differ.float().mean().item() < 1e-3
    q, s = quantize_blocks(torch.randn(n, k, generator=gen) * k ** -0.5)
    want = fp8_linear_reference(x, q, s, torch.float32)
    got = fp8_matmul(x.cuda(), q.cuda(), s.cuda(), torch.float32).cpu()
    # fp32 out against the product of the kernel's own activation codes: what is left is the summation
    # order and Hopper's fp8 MMA, which adds a 128-deep dot with fewer bits than fp32 (1.2e-4 relative
    # seen on the H200 at BLOCK_M 64). Against the CPU codes the rare one-step codes add ~2e-3 (H200).
    own = dequantize_blocks_rows(q_gpu.cpu(), s_gpu.cpu()) @ dequantize_blocks(q, s).t()
    assert ((got - own).norm() / own.norm()).item() < 1e-3
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    got16 = fp8_matmul(x.cuda(), q.cuda(), s.cuda()).cpu()
    assert got16.dtype == torch.bfloat16 and ((got16.float() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs CUDA sm90+ and triton")
def test_fp8_gelu_moe_at_diffusion_gemma_shapes_matches_the_reference_whatever_the_batch():
    """The 26B-A4B's experts (E=128, H=2816, I=704 = 5.5 groups, top-8), gelu-tanh, bf16: the CPU
    reference of the same codes, bit-equal rows alone and in a batch, graph replay."""
    from fluxlab.kernels.fp8_moe import fp8_fused_moe

    gen = torch.Generator().manual_seed(6)
    x, idx, wts, wgu, sgu, wd, sd = _moe_case(128, 2816, 704, 8, 512, gen, "cuda", torch.bfloat16)
    x = x * 4
    full = fp8_fused_moe(x, idx, wts, wgu, sgu, wd, sd, activation="gelu_tanh")
    want = fp8_moe_reference(x[:32].cpu(), idx[:32].cpu(), wts[:32].cpu(), wgu.cpu(), sgu.cpu(), wd.cpu(), sd.cpu(),
                             activation="gelu_tanh")
    assert ((full[:32].cpu().float() - want.float()).norm() / want.float().norm()).item() < 2e-2   # bf16 slots
    for rows in (1, 16, 256):
        assert torch.equal(fp8_fused_moe(x[:rows], idx[:rows], wts[:rows], wgu, sgu, wd, sd, activation="gelu_tanh"),
                           full[:rows])
    xs, ids, ws = x[:16].clone(), idx[:16].clone(), wts[:16].clone()
    fp8_fused_moe(xs, ids, ws, wgu, sgu, wd, sd, activation="gelu_tanh")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_fused_moe(xs, ids, ws, wgu, sgu, wd, sd, activation="gelu_tanh")
    xs.copy_(x[16:32]), ids.copy_(idx[16:32]), ws.copy_(wts[16:32])
    graph.replay()
    assert torch.equal(out, full[16:32])


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs CUDA sm90+ and triton")
def test_fp8_rows_do_not_depend_on_the_batch_and_replay_in_a_graph():
    from fluxlab.kernels.fp8_gemm import fp8_matmul
    from fluxlab.kernels.fp8_moe import fp8_fused_moe

    gen = torch.Generator().manual_seed(5)
    q, s = (t.cuda() for t in quantize_blocks(torch.randn(2048, 2048, generator=gen) * 0.02))
    x = torch.randn(2048, 2048, generator=gen).bfloat16().cuda()
    full = fp8_matmul(x, q, s)
    for rows in (1, 7, 64, 513):
        assert torch.equal(fp8_matmul(x[:rows], q, s), full[:rows])
    x, idx, wts, wgu, sgu, wd, sd = _moe_case(256, 2048, 512, 8, 2048, gen, "cuda", torch.bfloat16)
    full = fp8_fused_moe(x, idx, wts, wgu, sgu, wd, sd)
    for rows in (1, 32, 500):
        assert torch.equal(fp8_fused_moe(x[:rows], idx[:rows], wts[:rows], wgu, sgu, wd, sd), full[:rows])
    want = fp8_moe_reference(x[:64].cpu(), idx[:64].cpu(), wts[:64].cpu(), wgu.cpu(), sgu.cpu(), wd.cpu(), sd.cpu())
    assert ((full[:64].cpu().float() - want.float()).norm() / want.float().norm()).item() < 2e-2   # bf16 slots
    xs, ids, ws = x[:32].clone(), idx[:32].clone(), wts[:32].clone()
    fp8_fused_moe(xs, ids, ws, wgu, sgu, wd, sd)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_fused_moe(xs, ids, ws, wgu, sgu, wd, sd)
    xs.copy_(x[32:64]), ids.copy_(idx[32:64]), ws.copy_(wts[32:64])
    graph.replay()
    assert torch.equal(out, full[32:64])


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs CUDA sm90+ and triton")
@pytest.mark.parametrize("n,k", [(2048, 2048), (2816, 2112), (300, 200), (384, 272), (8192, 2816)])
def test_fp8_matmul_in_a_graph_takes_tma_tiles_with_the_eager_bits(n, k, monkeypatch):
    """Inside graph_tiles() (a graph's warm-up and capture) the GEMM loads tiles through TMA descriptors where
    K is a multiple of 16 (200 is not; 2112 and 272 are not whole 128-blocks): warm-up and captured rows equal
    the eager (pointer-load) rows, and every row count gives a row the bits it has in 2048 rows (8192 x 2816:
    Diffusion-Gemma's q/k/v, on its `NARROW_TILES` tile below WIDE_ROWS)."""
    from fluxlab.kernels import tma
    from fluxlab.kernels.fp8_gemm import fp8_matmul

    assert "fp8_gemm" in tma.KERNELS   # the default
    real, scoped = tma.fits, []

    def spy(*tensors):  # asked only inside graph_tiles()
        scoped.append(real(*tensors))
        return scoped[-1]
    monkeypatch.setattr(tma, "fits", spy)
    gen = torch.Generator().manual_seed(11)
    q, s = (t.cuda() for t in quantize_blocks(torch.randn(n, k, generator=gen) * 0.02))
    x = torch.randn(2048, k, generator=gen).bfloat16().cuda()
    full = fp8_matmul(x, q, s)  # eager: pointer loads
    assert not scoped
    for rows in (1, 7, 64, 513, 2048):
        xs = x[:rows].clone()
        with tma.graph_tiles():
            warm = fp8_matmul(xs, q, s)   # compiles the TMA kernel outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fp8_matmul(xs, q, s)
        graph.replay()
        assert torch.equal(warm, full[:rows]) and torch.equal(out, full[:rows]), rows
    assert scoped == [k % 16 == 0] * 10


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ok(), reason="needs CUDA sm90+ and triton")
def test_fp8_moe_with_the_shared_expert_last_is_the_routed_sum_plus_that_expert_on_gpu():
    """LLaDA2.0-mini's experts plus its shared expert stacked last (`fuse_shared_experts_`), bf16: the
    routed sum rounded, plus the shared expert alone, plus the residual, bit for bit; rows alone =
    in a batch."""
    from fluxlab.kernels.fp8_moe import fp8_fused_moe

    gen = torch.Generator().manual_seed(8)
    E, T = 256, 2048
    x, idx, wts, wgu, sgu, wd, sd = _moe_case(E + 1, 2048, 512, 8, T, gen, "cuda", torch.bfloat16)
    idx = idx % E
    residual = torch.randn(T, 2048, generator=gen).bfloat16().cuda()
    with_shared = (torch.cat([idx, torch.full((T, 1), E, device="cuda")], 1),
                   torch.cat([wts, torch.ones(T, 1, device="cuda")], 1))
    full = fp8_fused_moe(x, *with_shared, wgu, sgu, wd, sd, adds=(residual,), shared_last=True)
    routed = fp8_fused_moe(x, idx, wts, wgu, sgu, wd, sd)
    alone = fp8_fused_moe(x, torch.full((T, 1), E, device="cuda"), torch.ones(T, 1, device="cuda"), wgu, sgu, wd, sd)
    assert torch.equal(full, (routed + alone) + residual)
    for rows in (1, 32, 500):
        got = fp8_fused_moe(x[:rows], with_shared[0][:rows], with_shared[1][:rows], wgu, sgu, wd, sd,
                            adds=(residual[:rows],), shared_last=True)
        assert torch.equal(got, full[:rows])
    want = fp8_moe_reference(x[:64].cpu(), with_shared[0][:64].cpu(), with_shared[1][:64].cpu(), wgu.cpu(), sgu.cpu(),
                             wd.cpu(), sd.cpu(), adds=(residual[:64].cpu(),), shared_last=True)
    assert ((full[:64].cpu().float() - want.float()).norm() / want.float().norm()).item() < 2e-2


if __name__ == "__main__":
    _interpreter_checks()
