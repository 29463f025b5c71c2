"""Batch-invariant matmul (Triton): a row's output does not depend on how many rows share the call.

cuBLAS picks its algorithm per shape: at 256 rows (one Diffusion-Gemma canvas) a narrow or deep
product (the router's 128 columns, the self-conditioning input's 262144-long reduction) may run
split-K, at 16384 rows not, so the same row sums its products in another order and rounds
differently, and a request's tokens would depend on the batch it runs in. Here the reduction of each
output element is K-chunks of BLOCK_K (one value for every call) in order into one fp32 accumulator,
whatever the tile's columns, warps or stages, and whatever its rows from 64 up: the tensor cores add
each chunk in k16 steps in order, so a row's bits are a function of K alone. The output tile may
therefore follow the row count (`tile_for`: small tiles for one or two canvases, where the default
leaves most SMs idle). No tile of the H200 sweeps (2026-12-03/04, up to 11 configs x 9 shapes x
256..4096 rows) changed a bit, and tests/test_canvas_matmul.py checks rows alone (small tiles) against
rows among 2048 and 16384 (default tiles). Every tile has 64+ rows, the range the sweeps checked: on
sm90 a 16- or 32-row tile takes another MMA instruction (not warpgroup MMA), and the canvas
attention's sweep of 2026-12-04 saw 32-row query tiles change bits against 64-row ones (cause not
isolated: that instruction, or its row sums' reduction layout). Products with a long reduction are
cut into a number of K-slices fixed by K (`splits_for`), whose fp32 partials `_sum_slices_kernel` adds
in slice order, elementwise: never a number that depends on the rows.

(Slicing narrow weights by shape too, a canvas's slices as programs and a large batch's walked by one program -- the
same sums -- was measured twice and dropped: H200 2026-12-04, -0.9 ms a step at batch 1, +7 ms at batch 16; H100
2026-12-07 with TMA/persistent walks, within noise end to end, every shape but the router slower at 4096 rows.
docs/benchmarks.md; the code: git show 7d9a187:fluxlab/kernels/invariant_matmul.py.)

Inside `tma.graph_tiles()` (a CUDA graph's warm-up and capture, kernels/tma.py), where FLUXLAB_TMA names "matmul"
(the default), the x and w tiles come through TMA descriptors on sm90+: the same chunks in the same
order, so the same bits. A slice's chunks never straddle its end (k_per_split is whole chunks), so the descriptors'
zero fill past K, M and N stands in for every mask. From 1024 rows a one-slice product with fewer than
PERSISTENT_MAX_N columns launches them persistently (`tma.persistent`: two programs an SM walking the same tiles).

`matmul(x [M, K], w [N, K])` = x @ w.T (F.linear's layout); `w` may be any strided view (the
self-conditioning input multiplies by the embedding [V, H] itself: pass `embedding.t()`).
"""
from __future__ import annotations

import torch

from fluxlab.kernels import tma as tma_tiles
from fluxlab.kernels.fused_norm import HAVE_TRITON, _interpret, tl, triton
from fluxlab.kernels.pdl import launch as pdl_launch, start as pdl_start
from fluxlab.kernels.tile_order import tile_span

BLOCK_K, GROUP_M = 64, 8  # BLOCK_K is the reduction's chunk: one value, never per shape or row count
DEFAULT_TILE = (128, 128, 8, 3)  # (BLOCK_M, BLOCK_N, warps, stages)
SMALL_ROWS = 512  # up to two canvases take SMALL_TILES
# By weight shape (N, K), in the engine's layout (fused q/k/v 8192 or 9216 rows, fused gate/up 4224).
# H200 sweep 2026-12-04 (benchmarks/device/diffusion_gemma_matmul_tiles.py; docs/benchmarks/
# 2026-12-04_h200_diffusion_gemma_matmul_tiles.txt), us at 256 rows, default -> this: q/k/v 35 -> 30,
# o 40 -> 28 and 72 -> 51 (full layers), gate/up 31 -> 23, down 22 -> 17, router 17 -> 16; ~0.9 ms a
# step at one canvas. At 4096 rows the default wins every shape but the router's 128 columns. The
# self-conditioning product (the embedding as [K, N], (2816, 262144)) takes 128x256 tiles: H200 sweep with TMA
# tiles under graphs, 2026-12-07 (benchmarks/device/gemm_tma.py --sweep), 0.62 -> 0.56 ms at 256 rows and
# 10.9 -> 8.9 ms at 4096, the same bits.
SELF_CONDITIONING_TILE = (128, 256, 8, 3)
SMALL_TILES: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (8192, 2816): (64, 128, 4, 4), (2816, 4096): (64, 64, 4, 4), (2816, 8192): (64, 64, 4, 4),
    (4224, 2816): (64, 64, 4, 4), (2112, 2816): (64, 64, 4, 4), (2816, 2112): (64, 64, 4, 4),
    (128, 2816): (64, 32, 4, 4), (2816, 262144): SELF_CONDITIONING_TILE}
LARGE_TILES: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (128, 2816): (64, 64, 4, 4), (2816, 262144): SELF_CONDITIONING_TILE}
# Persistent launches (kernels/tma.py) only below this many columns: the head (262144) at 4096 rows took 11.0 ms a
# call per tile and 11.2-14.0 persistent (one H100, 2026-12-07).
PERSISTENT_MAX_N = 65536
SLICE_K = 16384  # K-slice length of a long reduction (262144 -> 16 slices)

if HAVE_TRITON:
    @triton.jit
    def _chunks(acc, x_ptr, w_ptr, x_desc, w_desc, k_lo, k_end, rows, cols, M, N, pid_m, pid_n, stride_xm, stride_xk,
                stride_wn, stride_wk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                IEEE: tl.constexpr, TMA: tl.constexpr, W_KN: tl.constexpr, WS: tl.constexpr = False):
        # WS (TMA, 4-warp tiles): Triton's warp specialization of the loop, a load warp beside the MMA warps -- the
        # same chunks in the same order; a candidate the tile sweep (diffusion_gemma_matmul_tiles.py) times, no
        # launch here sets it yet.
        # acc + the K-chunks [k_lo, k_end) in order. TMA: tiles through descriptors, x's over [M, K] and w's over
        # [N, K] or, W_KN, over [K, N] (w.t() contiguous); else pointers from k_lo
        offs_k = tl.arange(0, BLOCK_K)
        if not TMA:
            x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k_lo + offs_k)[None, :].to(tl.int64) * stride_xk
            w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + (k_lo + offs_k)[:, None].to(tl.int64) * stride_wk
        for k in tl.range(k_lo, k_end, BLOCK_K, warp_specialize=WS):
            if TMA:
                a = x_desc.load([pid_m * BLOCK_M, k])
                if W_KN:
                    b = w_desc.load([k, pid_n * BLOCK_N])
                else:
                    b = w_desc.load([pid_n * BLOCK_N, k]).T
            else:
                k_ok = (k + offs_k) < k_end
                a = tl.load(x_ptrs, mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=k_ok[:, None] & (cols[None, :] < N), other=0.0)
                x_ptrs += BLOCK_K * stride_xk
                w_ptrs += BLOCK_K * stride_wk
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _matmul_kernel(x_ptr, w_ptr, x_desc, w_desc, out_ptr, M, N, K, k_per_split, stride_xm, stride_xk, stride_wn,
                       stride_wk, stride_os, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr,
                       W_KN: tl.constexpr, WS: tl.constexpr = False, PDL: tl.constexpr = False):
        # program_id(1): the K-slice this program sums
        pdl_start(PDL)
        pid_m, pid_n, rows, cols = tile_span(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        split = tl.program_id(1)
        k_start = split * k_per_split
        total = _chunks(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), x_ptr, w_ptr, x_desc, w_desc, k_start,
                        tl.minimum(k_start + k_per_split, K), rows, cols, M, N, pid_m, pid_n, stride_xm, stride_xk,
                        stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, TMA, W_KN, WS)
        o_ptrs = (out_ptr + split.to(tl.int64) * stride_os + rows[:, None].to(tl.int64) * stride_om
                  + cols[None, :])
        tl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))

    @triton.jit
    def _persistent_matmul_kernel(x_desc, w_desc, out_ptr, M, N, K, stride_om, PROGRAMS, BLOCK_M: tl.constexpr,
                                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                                  W_KN: tl.constexpr, PDL: tl.constexpr = False):
        # TMA tiles, one K-slice: PROGRAMS programs walk the tiles of `_matmul_kernel`'s grid in its order, each
        # summing the same chunks in the same order (kernels/tma.py)
        pdl_start(PDL)
        for tile in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N), PROGRAMS):
            pid_m, pid_n, rows, cols = tile_span(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            total = _chunks(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), None, None, x_desc, w_desc, 0, K, rows,
                            cols, M, N, pid_m, pid_n, 0, 0, 0, 0, BLOCK_M, BLOCK_N, BLOCK_K, False, True, W_KN)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
                     total.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))

    @triton.jit
    def _sum_slices_kernel(parts_ptr, out_ptr, numel, SLICES: tl.constexpr, BLOCK: tl.constexpr,
                           PDL: tl.constexpr = False):
        # slice 0, then + slice 1, + slice 2, ... in fp32, rounded once to the output dtype
        pdl_start(PDL)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < numel
        ptrs = parts_ptr + offs
        total = tl.load(ptrs, mask=ok, other=0.0)
        for _ in range(1, SLICES):
            ptrs += numel  # a pointer step per slice: no slice index times numel to overflow int32
            total += tl.load(ptrs, mask=ok, other=0.0)
        tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


def use_kernel(x: torch.Tensor) -> bool:
    """CUDA half-precision inputs (the bf16 serving path); fp32 and CPU keep F.linear (parity runs)."""
    return HAVE_TRITON and ((x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)) or _interpret())


def splits_for(k: int) -> int:
    """K-slices of a reduction of length k: a function of k alone (batch invariance)."""
    return max(1, -(-k // SLICE_K)) if k > 2 * SLICE_K else 1


def tile_for(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) of an [m, k] x [k, n] product: free to follow m (module doc)."""
    table = SMALL_TILES if m <= SMALL_ROWS else LARGE_TILES
    return table.get((n, k), DEFAULT_TILE)


def matmul(x: torch.Tensor, w: torch.Tensor, tiles: tuple | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T -> [M, N] in x.dtype, fp32 accumulation, batch-invariant (module doc). tiles:
    (BLOCK_M, BLOCK_N, warps, stages, tma[, persistent]) instead of `tile_for`, `tma.graph_tiles()` and
    `tma.persistent` (benchmarks only)."""
    if not HAVE_TRITON:
        raise RuntimeError("invariant matmul needs triton")
    M, K = x.shape
    N, K_w = w.shape
    assert K == K_w, (x.shape, w.shape)
    block_m, block_n, warps, stages, tma, persistent = (*tiles, False)[:6] if tiles else (
        *tile_for(M, N, K), tma_tiles.wanted("matmul"), tma_tiles.persistent("matmul", M) and N < PERSISTENT_MAX_N)
    w_kn = w.stride(0) == 1 and w.stride(1) != 1  # a [K, N] weight seen through .t()
    x_desc = w_desc = None
    if tma and M and tma_tiles.fits(x, w.t() if w_kn else w):
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_desc = TensorDescriptor.from_tensor(x, [block_m, BLOCK_K])
        w_desc = (TensorDescriptor.from_tensor(w.t(), [BLOCK_K, block_n]) if w_kn
                  else TensorDescriptor.from_tensor(w, [block_n, BLOCK_K]))
    splits = splits_for(K)
    k_per_split = -(-K // splits)
    k_per_split = -(-k_per_split // BLOCK_K) * BLOCK_K
    splits = -(-K // k_per_split)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if persistent and x_desc is not None and splits == 1:
        grid = tma_tiles.programs(x.device, triton.cdiv(M, block_m) * triton.cdiv(N, block_n))
        _persistent_matmul_kernel[(grid,)](x_desc, w_desc, out, M, N, K, out.stride(0), PROGRAMS=grid,
                                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M,
                                           W_KN=w_kn, num_warps=warps, num_stages=stages, **pdl_launch())
        return out
    parts = out if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n), splits)
    _matmul_kernel[grid](x, w, x_desc, w_desc, parts, M, N, K, k_per_split, x.stride(0), x.stride(1), w.stride(0),
                         w.stride(1), parts.stride(0) if parts is not out else 0, parts.stride(-2), BLOCK_M=block_m,
                         BLOCK_N=block_n, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, IEEE=x.dtype == torch.float32,
                         TMA=x_desc is not None, W_KN=w_kn and x_desc is not None, num_warps=warps, num_stages=stages,
                         **pdl_launch())
    if parts is not out:
        block = 1024
        _sum_slices_kernel[(triton.cdiv(M * N, block),)](parts, out, M * N, SLICES=splits, BLOCK=block, **pdl_launch())
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear without bias, through `matmul` where `use_kernel` (any leading dims)."""
    if not use_kernel(x):
        return torch.nn.functional.linear(x, weight)
    return matmul(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
