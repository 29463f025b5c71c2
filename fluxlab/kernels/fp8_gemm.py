"""Block-scaled FP8 GEMM (Triton): x [M, K] (bf16/fp16/fp32) @ dequant(w [N, K] e4m3).T.

The weight is the DeepSeek-V3 / Qwen3-FP8 layout (fluxlab/engine/layers/fp8.py): e4m3 plus fp32
`weight_scale_inv` [ceil(N/128), ceil(K/128)]. The activations are quantized per token and 128-wide
group by `quantize_act` (one launch, a program per row), then the GEMM walks K in steps of 128: one
e4m3 x e4m3 tensor-core dot per step, its fp32 result scaled by the row's activation scale and the
column's weight scale and added to the fp32 accumulator (DeepSeek's fp8_gemm, vLLM's
w8a8_block_fp8_matmul). A fresh dot per 128-deep step also keeps Hopper's fp8 MMA, which accumulates
with fewer bits than fp32, to 128 products (DeepSeek-V3's "promotion" interval).

Quantizing the tile inside the GEMM instead (each K-step quantizing its [BLOCK_M, 128] slice of x)
was measured on the H200 and dropped: every N-tile redoes the same quantization, and at BLOCK_M 64 the
qkv product at 32 tokens took 0.11 ms against cuBLAS bf16's 0.006 (docs/benchmarks.md, FP8). So was
cutting K into segments fixed by the weight's shape (split-K with the same bits at every batch: segments
as programs plus a summing kernel when tiles are few, walked by one program otherwise): slower at 32,
256 and 2048 rows on an H100 (2026-12-06, docs/benchmarks.md). Taking two K-blocks an iteration (both dots
before either add, the same bits) was slower at 256-4096 rows under graphs. What did pay is TMA tiles (TMA below),
from 1024 rows their persistent launch (`tma.persistent`: two programs an SM walking the same tiles), and loading
each K-block's scales one iteration ahead (`_scale_ptrs`; the same bits, H100 2026-12-08).

Batch invariant and graph capturable: BLOCK_M 64 whatever M is (BLOCK_N and the pipeline stages by row count
and weight shape, `tile_for`, which leaves the bits unchanged), the reduction of every output element is the
K-blocks in order into one fp32 accumulator (no split-K), and no host reads.

Quantization arithmetic matches `quantize_token_groups` bit for bit: per group, amax (at least
1e-10), inv = 448 / amax and s = amax / 448 by IEEE divisions (`div_rn`; Triton's plain fp32 `/` is
an approximation on NVIDIA GPUs), q = clamp(x * inv, -448, 448) rounded to nearest even. Under the
interpreter (TRITON_INTERPRET=1, CPU tests) triton's fp32 -> e4m3 cast mis-rounds a value that rounds
up into the next binade (31.82 -> 16, seen with triton 3.9), so there the rounding is done in fp32
first (`_round_e4m3`) and the cast only sees representable values.
"""
from __future__ import annotations

import torch

from fluxlab.kernels import tma as tma_tiles
from fluxlab.kernels.moe_align import HAVE_TRITON, _interpret, tl, triton  # noqa: F401
from fluxlab.kernels.pdl import launch as pdl_launch, start as pdl_start
from fluxlab.kernels.tile_order import grouped_tile, tile_span

GROUP = 128  # the activation group and weight block width along K: BLOCK_K must equal it
# 64-wide output tiles below WIDE_ROWS rows, 128-wide from there: the same bits either way (one wgmma
# path, the same K order; the sweep's bit check and test_fp8_rows_do_not_depend_on_the_batch), so rows
# stay batch invariant. H100 (benchmarks/device/diffusion_gemma_matmul_tiles.py --fp8, docs/benchmarks.md):
# 128 wide wins at 2048-4096 rows (LLaDA2.0-mini 2.13 vs 2.44 ms a step, DG 26.0 vs 30.2), loses at 256
# (DG 9.9 vs 6.9) and cost LLaDA's batch-1 forward ~0.1 ms. The wide tiles take 3 stages, not 4: H200 sweep
# with TMA tiles under graphs, 2026-12-07 (benchmarks/device/gemm_tma.py --sweep), DG's GEMMs a step at 4096 rows
# 21.0 -> 19.0 ms, LLaDA's at 2048 1.61 either way, the same bits.
BLOCK_M, BLOCK_N, WIDE_N, WIDE_ROWS, WARPS, STAGES, WIDE_STAGES, GROUP_M = 64, 64, 128, 1024, 4, 4, 3, 8
# Below WIDE_ROWS, by weight shape (N, K): H200 sweep with TMA tiles under graphs, 2026-12-07 (gemm_tma.py --sweep,
# docs/benchmarks/2026-12-07_h200_gemm_tma_fp8_sweep.txt), us at 256 rows: Diffusion-Gemma's fused q/k/v 27.2 -> 20.6
# (sliding layers) and 28.0 -> 24.3 (full layers), ~0.18 ms a step at one canvas; the same bits.
NARROW_TILES: dict[tuple[int, int], tuple[int, int, int, int]] = {(8192, 2816): (64, 128, 4, 3),
                                                                   (9216, 2816): (64, 128, 4, 3)}
# x and w tiles through TMA descriptors inside `tma.graph_tiles()` (kernels/tma.py: a CUDA graph's warm-up and
# capture): the same bits as pointer loads, faster under graphs at 32-4096 rows on an H100.

if HAVE_TRITON:
    import fluxlab.kernels.fused_norm  # noqa: F401  (patches the interpreter under TRITON_INTERPRET=1)

    @triton.jit
    def _div(a, b, INTERPRET: tl.constexpr):
        if INTERPRET:
            return a / b
        else:
            return tl.math.div_rn(a, b)

    @triton.jit
    def _round_e4m3(v):
        """v fp32 with |v| <= 448 -> v rounded to the nearest e4m3 value (ties to even), still fp32:
        adding and subtracting 1.5 * 2**23 * ulp rounds at the ulp (fp32 adds round to nearest even)."""
        bits = v.to(tl.int32, bitcast=True)
        exp = tl.maximum((bits >> 23) & 0xFF, 121)        # 121: 2**-6, e4m3's smallest normal binade
        magic = (((exp - 3 + 23) << 23) | 0x400000).to(tl.float32, bitcast=True)
        return (v + magic) - magic

    @triton.jit
    def quant_tile(a, INTERPRET: tl.constexpr):
        """a [BM, 128] -> (e4m3 [BM, 128], fp32 scales [BM]): per row, amax = max(|a|, 1e-10),
        s = amax / 448, q = clamp(a * (448 / amax), -448, 448) rounded to nearest even."""
        a = a.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-10)
        s = _div(amax, 448.0, INTERPRET)
        inv = _div(tl.zeros_like(amax) + 448.0, amax, INTERPRET)
        v = a * inv[:, None]
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        if INTERPRET:
            v = _round_e4m3(v)
        return v.to(tl.float8e4nv), s

    @triton.jit
    def _quantize_act_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, NUM_GROUPS: tl.constexpr,
                             BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        groups = tl.arange(0, NUM_GROUPS)
        cols = groups[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
        inside = cols < K
        x = tl.load(x_ptr + row * stride_xm + cols, mask=inside, other=0.0)
        q, s = quant_tile(x, INTERPRET)
        tl.store(q_ptr + row * stride_qm + cols, q, mask=inside)
        tl.store(s_ptr + row * stride_sm + groups, s, mask=groups * BLOCK_K < K)

    # Each K-block's scales are loaded one iteration ahead of their use (the kernels here and in fp8_moe.py): a load
    # in the iteration that uses it is not pipelined (it feeds the dot's result, not its operands), so its latency
    # stood in every iteration of a short-M GEMM. One block ahead only: Triton's pipeliner skips a loop whose carried
    # values reach further back than one iteration.
    @triton.jit
    def _scale_ptrs(ws_ptr, col0, cols, stride_wsn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """A weight tile's scale pointers along K: at most BLOCK_K wide, the tile lies in one scale block (col0's),
        so one pointer (each column would load the same value); wider, a pointer a column."""
        if BLOCK_N <= BLOCK_K:
            return ws_ptr + (col0 // BLOCK_K) * stride_wsn
        else:
            return ws_ptr + (cols // BLOCK_K) * stride_wsn

    @triton.jit
    def _load_scale(ptrs, kb, ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """K-block kb's weight scale(s) from `_scale_ptrs` (zero past N for a pointer a column)."""
        if BLOCK_N <= BLOCK_K:
            return tl.load(ptrs + kb)
        else:
            return tl.load(ptrs + kb, mask=ok, other=0.0)

    @triton.jit
    def _scales_at(xs_ptrs, ws_ptrs, kb, row_ok, col_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """K-block kb's activation scales (zero past M) and weight scale(s) (`_load_scale`)."""
        return tl.load(xs_ptrs + kb, mask=row_ok, other=0.0), _load_scale(ws_ptrs, kb, col_ok, BLOCK_N, BLOCK_K)

    @triton.jit
    def _scaled(d, a_s, b_s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """A K-block's product times its scales, activation scale first (the order every path keeps)."""
        if BLOCK_N <= BLOCK_K:
            return d * a_s[:, None] * b_s
        else:
            return d * a_s[:, None] * b_s[None, :]

    @triton.jit
    def _fp8_gemm_kernel(xq_ptr, xs_ptr, w_ptr, x_desc, w_desc, ws_ptr, out_ptr, M, N, K, stride_xm, stride_xsm,
                         stride_wn, stride_wsn, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
                         WS: tl.constexpr = False, PDL: tl.constexpr = False):
        # TMA: x and w tiles through tensor descriptors (zero fill past M, N and K, as the masks give). WS (TMA only:
        # the pointer path fails Triton's warp specialization pass): a load warp beside the MMA warps, the same
        # K-blocks in the same order; the tile sweep's candidate (benchmarks/device/diffusion_gemma_matmul_tiles.py).
        pdl_start(PDL)
        pid_m, pid_n, rows, cols = tile_span(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_k = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        col_ok = cols < N
        x_ptrs = xq_ptr + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        xs_ptrs = xs_ptr + rows.to(tl.int64) * stride_xsm
        ws_ptrs = _scale_ptrs(ws_ptr, pid_n * BLOCK_N, cols, stride_wsn, BLOCK_N, BLOCK_K)
        num_kb = tl.cdiv(K, BLOCK_K)
        a_s_next, b_s_next = _scales_at(xs_ptrs, ws_ptrs, 0, row_ok, col_ok, BLOCK_N, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in tl.range(0, num_kb, warp_specialize=WS):
            if TMA:
                a = x_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
                b = w_desc.load([pid_n * BLOCK_N, kb * BLOCK_K]).T
            elif EVEN_K:
                a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < K - kb * BLOCK_K
                a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            a_s, b_s = a_s_next, b_s_next
            # the last iteration reloads its own block's (unused)
            a_s_next, b_s_next = _scales_at(xs_ptrs, ws_ptrs, tl.minimum(kb + 1, num_kb - 1), row_ok, col_ok,
                                            BLOCK_N, BLOCK_K)
            acc += _scaled(tl.dot(a, b), a_s, b_s, BLOCK_N, BLOCK_K)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _persistent_fp8_gemm_kernel(x_desc, w_desc, xs_ptr, ws_ptr, out_ptr, M, N, K, stride_xsm, stride_wsn,
                                    stride_om, PROGRAMS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr = False):
        # TMA tiles: PROGRAMS programs walk `_fp8_gemm_kernel`'s tiles in its order, each summing the same K-blocks
        # in the same order (kernels/tma.py)
        pdl_start(PDL)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        for tile in range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS):
            pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = rows < M
            col_ok = cols < N
            xs_ptrs = xs_ptr + rows.to(tl.int64) * stride_xsm
            ws_ptrs = _scale_ptrs(ws_ptr, pid_n * BLOCK_N, cols, stride_wsn, BLOCK_N, BLOCK_K)
            num_kb = tl.cdiv(K, BLOCK_K)
            a_s_next, b_s_next = _scales_at(xs_ptrs, ws_ptrs, 0, row_ok, col_ok, BLOCK_N, BLOCK_K)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for kb in range(0, num_kb):
                a = x_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
                b = w_desc.load([pid_n * BLOCK_N, kb * BLOCK_K]).T
                a_s, b_s = a_s_next, b_s_next
                a_s_next, b_s_next = _scales_at(xs_ptrs, ws_ptrs, tl.minimum(kb + 1, num_kb - 1), row_ok, col_ok,
                                                BLOCK_N, BLOCK_K)
                acc += _scaled(tl.dot(a, b), a_s, b_s, BLOCK_N, BLOCK_K)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K/128)]) per token and 128-wide group, the
    numbers of `fluxlab.engine.layers.fp8.quantize_token_groups` (one launch, sync-free)."""
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_groups = -(-k // GROUP)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, num_groups, dtype=torch.float32, device=x.device)
    if m:
        _quantize_act_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), s.stride(0),
                                   NUM_GROUPS=triton.next_power_of_2(num_groups), BLOCK_K=GROUP,
                                   INTERPRET=_interpret(), num_warps=4, **pdl_launch())
    return q, s


def tile_for(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) for an [m, k] @ [n, k].T product: by row count and weight shape, never a
    choice that changes a bit (module doc)."""
    if m >= WIDE_ROWS:
        return BLOCK_M, WIDE_N, WARPS, WIDE_STAGES
    return NARROW_TILES.get((n, k), (BLOCK_M, BLOCK_N, WARPS, STAGES))


def fp8_matmul(x: torch.Tensor | tuple, weight: torch.Tensor, scale_inv: torch.Tensor,
               out_dtype: torch.dtype | None = None, tiles: tuple | None = None) -> torch.Tensor:
    """x [M, K] (or its `quantize_act` pair, to share one quantization between GEMMs: then out_dtype
    is required) @ dequant(weight [N, K], scale_inv [ceil(N/128), ceil(K/128)]).T -> [M, N] in
    out_dtype (default x.dtype). tiles: (BLOCK_M, BLOCK_N, warps, stages[, tma[, persistent[, ws]]]) instead of the
    module's tile choice, `tma.graph_tiles()` and `tma.persistent` (benchmarks only: a config whose bits differ would
    give up batch invariance); ws: warp specialization of the per-tile kernel's TMA loop (a candidate no launch in the
    engine sets yet)."""
    if not HAVE_TRITON:
        raise RuntimeError("fp8_matmul needs triton")
    if isinstance(x, tuple):
        xq, xs = x
        assert out_dtype is not None, "fp8_matmul on a quantized pair needs out_dtype"
    else:
        out_dtype = out_dtype or x.dtype
        xq, xs = quantize_act(x)
    m, k = xq.shape
    n, k_w = weight.shape
    block_m, block_n, warps, stages, tma, persistent, ws = (*tiles, 0, False, False)[:7] if tiles else (
        *tile_for(m, n, k), tma_tiles.wanted("fp8_gemm"), tma_tiles.persistent("fp8_gemm", m), False)
    assert k == k_w and scale_inv.shape == (-(-n // GROUP), -(-k // GROUP)), (xq.shape, weight.shape, scale_inv.shape)
    assert weight.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32, (weight.dtype, scale_inv.dtype)
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    tma = bool(tma) and tma_tiles.fits(xq, weight)
    x_desc = w_desc = None
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_desc = TensorDescriptor.from_tensor(xq, [block_m, GROUP])
        w_desc = TensorDescriptor.from_tensor(weight, [block_n, GROUP])
    tiles_mn = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if tma and persistent:
        grid = tma_tiles.programs(xq.device, tiles_mn)
        _persistent_fp8_gemm_kernel[(grid,)](x_desc, w_desc, xs, scale_inv, out, m, n, k, xs.stride(0),
                                             scale_inv.stride(0), out.stride(0), PROGRAMS=grid, BLOCK_M=block_m,
                                             BLOCK_N=block_n, BLOCK_K=GROUP, GROUP_M=GROUP_M, num_warps=warps,
                                             num_stages=stages, **pdl_launch())
        return out
    grid = (tiles_mn,)
    _fp8_gemm_kernel[grid](xq, xs, weight, x_desc, w_desc, scale_inv, out, m, n, k, xq.stride(0), xs.stride(0),
                           weight.stride(0), scale_inv.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                           BLOCK_K=GROUP, GROUP_M=GROUP_M, EVEN_K=k % GROUP == 0, TMA=tma, WS=bool(ws) and tma,
                           num_warps=warps, num_stages=stages, **pdl_launch())
    return out
