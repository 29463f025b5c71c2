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
else:
    grouped_tile = None  # a machine without triton imports the kernels' modules, never launches them
