"""The order in which a Triton GEMM's programs take their output tiles, one for every GEMM here.

Grouped order: consecutive programs keep one column strip and walk GROUP_M row blocks (at large token counts
mostly one expert's rows in the MoE kernels), so a weight strip is read from HBM once and reused from L2. Which
program computes a tile never changes what the tile sums, so the order is free to change without changing a bit.
"""
from __future__ import annotations

from fluxlab.kernels.fused_norm import HAVE_TRITON, tl, triton

if HAVE_TRITON:
    @triton.jit
    def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
        """Program (or a persistent program's turn) `pid` -> its tile's (row block, column block)."""
        group = GROUP_M * num_pid_n
        first_m = (pid // group) * GROUP_M
        size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
        return first_m + (pid % group) % size_m, (pid % group) // size_m

    @triton.jit
    def tile_span(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """A GEMM's output tile `tile` of [M, N] in grouped order -> (row block, column block, its rows, its
        columns)."""
        pid_m, pid_n = grouped_tile(tile, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
        return pid_m, pid_n, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
else:
    grouped_tile = tile_span = None  # a machine without triton imports the kernels' modules, never launches them
