"""MoE align: sort the (token, k) slots by expert into BLOCK_M-padded runs (Triton, sync-free).

`moe_align(topk_idx, E, BLOCK_M)` -> (sorted_ids, expert_ids, total), the layout the fused MoE
GEMMs read: every expert e gets a run of rows starting at a multiple of BLOCK_M and padded to one,
holding the flat slot indices t*K+k routed to e in increasing order (the sentinel T*K in padding
rows); expert_ids[b] is the expert of row block b; total (on device) is the number of rows used.
Ids outside [0, E) (expert parallel: slots of another rank) are never placed.

A counting sort in O(slots), no host sync, fixed launch sizes (CUDA-graph capturable):
1. `_chunk_hist_kernel` (grid = chunks of CHUNK slots): per-chunk expert histogram.
2. `_chunk_scan_kernel` (one program): per expert, its padded run's start (exclusive prefix over
   experts) plus the prefix over earlier chunks -> base[c, e], the row of chunk c's first slot of
   e; total; each expert's run start and slot count.
3. `_chunk_scatter_kernel` (grid = chunks): sorts the chunk by (expert, position) and writes each
   slot to base[c, e] + its rank among the chunk's slots of e; a slot starting a row block writes
   the block's expert; program c also writes the sentinel into the padding rows of its share of
   the experts.
For few slots and short pads (`default_chunk`) the three run in one program (`_single_chunk_align_kernel`).
Chunks are taken in order and each is sorted stably, so the rows are the same as the scan's:
slots keep their original order inside an expert, and the GEMMs downstream see the same input.

`moe_align_scan` is the previous align (grid E, each program scanning every slot: O(E * slots));
the tests and `python -m fluxlab.bench.moe_layer --old-vs-new` check and time one against the other. It was the default
between one program's worth of slots and 16384 until chunks of 512 (not 1024) made the counting
sort faster everywhere: H200, E 256, top-8, us per call under a CUDA graph (docs/benchmarks.md §21),
BLOCK_M 16, 2048 tokens: scan 24.0, chunks of 1024 19.6, 512 14.3, 256 16.2; 4096 tokens: 44.7 / 21.7 /
18.1 / 23.6. At the tuned BLOCK_M 128, with the padding written by the scatter programs: 11.8 and 15.3 in
chunks of 512 (the scan 24.1 and 44.8).

This module also holds the Triton import and the interpreter patch the other kernel files use.
"""
from __future__ import annotations

import os

import torch

from fluxlab.kernels.pdl import launch as pdl_launch, start as pdl_start

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except Exception:  # pragma: no cover - triton absent on the CPU CI image
    triton = None
    tl = None
    HAVE_TRITON = False

SINGLE_CHUNK_MAX = 256  # slots aligned by one program (32 tokens at top-8), at BLOCK_M <= SINGLE_CHUNK_BLOCK_M
SINGLE_CHUNK_BLOCK_M = 16
CHUNKS, MIN_CHUNK, CHUNK = 32, 128, 512  # above that: ~CHUNKS programs of MIN_CHUNK .. CHUNK slots


def default_chunk(num_slots: int, block_m: int) -> int:
    """Slots per program. One program pads every expert's run in BLOCK_M - 1 dependent store rounds
    and sorts all the slots itself, so it only wins for few slots and short pads; otherwise about
    CHUNKS chunks run the hist/scan/scatter launches. H100, us a call under a graph
    (benchmarks/device/moe_align_sweep.py, docs/benchmarks.md): LLaDA2.0-mini bf16 b1 (256 slots,
    BLOCK_M 16) one program 5.3, chunks of 64 7.2; fp8 b1 (288 slots, 257 experts, BLOCK_M 64) one
    program 15.1, chunks of 128 7.9; Diffusion-Gemma canvas (2048 slots) one program 8.9, chunks of
    128 7.3; 16384-18432 slots: chunks of 512 11.9-14.2, of 256 14.2-16.3. The rows do not depend on it."""
    if num_slots <= SINGLE_CHUNK_MAX and block_m <= SINGLE_CHUNK_BLOCK_M:
        return max(16, _next_pow2(num_slots))
    return min(CHUNK, max(MIN_CHUNK, _next_pow2(-(-num_slots // CHUNKS))))


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def _patch_interpreter_for_numpy2() -> None:
    """Two interpreter patches (TRITON_INTERPRET=1). tl.dot sums in K order (`_dot_in_k_order`). And
    triton 3.6's interpreter turns scalar args into 1-element arrays and calls int() on them for
    `range(...)` bounds, which NumPy >= 2.4 rejects ("only 0-dimensional arrays can be converted").
    Re-point `tensor.__index__` at `.item()` after the interpreter's own patching. CPU-only
    (TRITON_INTERPRET=1); no effect on compiled kernels."""
    try:
        from triton.runtime import interpreter as _interp
    except Exception:
        return
    orig = getattr(_interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_fluxlab_patched", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._fluxlab_patched = True
    _interp._patch_lang_tensor = patched
    _interp.InterpreterBuilder.create_dot = _dot_in_k_order


def _dot_in_k_order(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter's tl.dot, its products summed over K in order for every output element. Its own
    np.matmul sums as the CPU's BLAS blocks the shape, so a row's bits moved with the tile's width on some
    CPUs (OpenBLAS 0.3.31, numpy 2.4.6): the interpreter checks of tile-independent bits (tests/
    test_canvas_matmul.py) then failed for BLAS's reasons, not the kernel's. e4m3 inputs go through fp16
    as the interpreter's own dot does; their fp32 products are exact."""
    import numpy as np
    from triton.runtime.interpreter import TensorHandle, _convert_float

    a_data, b_data = a.data, b.data
    if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
       (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):
        a_data = _convert_float(a_data, a.dtype, tl.float16, None).view(np.float16)
        b_data = _convert_float(b_data, b.dtype, tl.float16, None).view(np.float16)
    dtype = d.data.dtype
    a_data, b_data = a_data.astype(dtype), b_data.astype(dtype)
    total = np.zeros(a_data.shape[:-1] + b_data.shape[-1:], dtype=dtype)
    for k in range(a_data.shape[-1]):
        total += a_data[..., k:k + 1] * b_data[..., k:k + 1, :]
    return TensorHandle(total + d.data, d.dtype.scalar)


if HAVE_TRITON and _interpret():
    _patch_interpreter_for_numpy2()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def max_padded_rows(num_slots: int, num_experts: int, block_m: int) -> int:
    """Worst-case rows after padding every expert's run to a multiple of block_m."""
    rows = num_slots + min(num_experts, num_slots) * (block_m - 1)
    return _cdiv(rows, block_m) * block_m


if HAVE_TRITON:

    @triton.jit
    def _chunk_experts(topk_ptr, c, N, E, CHUNK: tl.constexpr):
        # The experts of chunk c's slots; E ("nowhere": foreign slots, past the end) where not in [0, E).
        offs = c * CHUNK + tl.arange(0, CHUNK)
        ids = tl.load(topk_ptr + offs, mask=offs < N, other=E).to(tl.int32)
        return tl.where((ids >= 0) & (ids < E), ids, E)

    @triton.jit
    def _write_padding(sorted_ids_ptr, start, counts, padded, N, BLOCK_M: tl.constexpr):
        # rows start+counts .. start+padded-1 of every expert get the sentinel N
        sentinel = tl.zeros_like(counts) + N
        for j in range(0, BLOCK_M - 1):
            tl.store(sorted_ids_ptr + start + counts + j, sentinel, mask=counts + j < padded)

    @triton.jit
    def _scatter_chunk(experts, base, c, sorted_ids_ptr, expert_ids_ptr, E,
                       BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, W: tl.constexpr):
        # base [W]: the row of this chunk's first slot of each expert. Sorting (expert, position)
        # keys puts the chunk's slots of expert e at sorted positions below[e] .. below[e]+n-1 in
        # their original order, so a slot's row is base[e] + (sorted position - below[e]).
        pos = tl.arange(0, CHUNK)
        hist = tl.histogram(experts, W)
        below = tl.cumsum(hist, axis=0) - hist
        key = tl.sort(experts * CHUNK + pos)
        e = key // CHUNK
        placed = e < E
        e_in = tl.where(placed, e, 0)
        dest = tl.gather(base - below, e_in, 0) + pos
        tl.store(sorted_ids_ptr + dest, c * CHUNK + (key - e * CHUNK), mask=placed)
        tl.store(expert_ids_ptr + dest // BLOCK_M, e, mask=placed & (dest % BLOCK_M == 0))

    @triton.jit
    def _single_chunk_align_kernel(topk_ptr, sorted_ids_ptr, expert_ids_ptr, total_ptr, N, E,
                                   BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, W: tl.constexpr,
                                   PDL: tl.constexpr = False):
        pdl_start(PDL)
        experts = _chunk_experts(topk_ptr, 0, N, E, CHUNK)
        offs_e = tl.arange(0, W)
        counts = tl.where(offs_e < E, tl.histogram(experts, W), 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        start = tl.cumsum(padded, axis=0) - padded
        tl.store(total_ptr, tl.sum(padded, axis=0))
        _write_padding(sorted_ids_ptr, start, counts, padded, N, BLOCK_M)
        _scatter_chunk(experts, start, 0, sorted_ids_ptr, expert_ids_ptr, E, BLOCK_M, CHUNK, W)

    @triton.jit
    def _chunk_hist_kernel(topk_ptr, chunk_counts_ptr, N, E, CHUNK: tl.constexpr, W: tl.constexpr,
                           PDL: tl.constexpr = False):
        pdl_start(PDL)
        c = tl.program_id(0)
        hist = tl.histogram(_chunk_experts(topk_ptr, c, N, E, CHUNK), W)
        offs_e = tl.arange(0, W)
        tl.store(chunk_counts_ptr + c * W + offs_e, tl.where(offs_e < E, hist, 0))

    @triton.jit
    def _chunk_scan_kernel(chunk_counts_ptr, base_ptr, runs_ptr, total_ptr, num_chunks,
                           BLOCK_M: tl.constexpr, W: tl.constexpr, CB: tl.constexpr, PDL: tl.constexpr = False):
        # chunk_counts [num_chunks, W] -> base [num_chunks, W], CB chunks at a time; runs [2, W]: each
        # expert's run start and slot count, for the scatter programs to pad (one program writing every
        # padding row took 127 dependent store rounds at BLOCK_M 128: ~26 us of a 2048-token layer).
        pdl_start(PDL)
        offs_e = tl.arange(0, W)
        counts = tl.zeros([W], dtype=tl.int32)
        for c0 in range(0, num_chunks, CB):
            offs_c = c0 + tl.arange(0, CB)
            block = tl.load(chunk_counts_ptr + offs_c[:, None] * W + offs_e[None, :],
                            mask=offs_c[:, None] < num_chunks, other=0)
            counts += tl.sum(block, axis=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        start = tl.cumsum(padded, axis=0) - padded
        tl.store(total_ptr, tl.sum(padded, axis=0))
        tl.store(runs_ptr + offs_e, start)
        tl.store(runs_ptr + W + offs_e, counts)
        carry = start
        for c0 in range(0, num_chunks, CB):
            offs_c = c0 + tl.arange(0, CB)
            in_range = offs_c[:, None] < num_chunks
            block = tl.load(chunk_counts_ptr + offs_c[:, None] * W + offs_e[None, :], mask=in_range, other=0)
            tl.store(base_ptr + offs_c[:, None] * W + offs_e[None, :],
                     carry[None, :] + tl.cumsum(block, axis=0) - block, mask=in_range)
            carry += tl.sum(block, axis=0)

    @triton.jit
    def _chunk_scatter_kernel(topk_ptr, base_ptr, runs_ptr, sorted_ids_ptr, expert_ids_ptr, N, E,
                              BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, W: tl.constexpr, EPP: tl.constexpr,
                              PDL: tl.constexpr = False):
        pdl_start(PDL)
        c = tl.program_id(0)
        base = tl.load(base_ptr + c * W + tl.arange(0, W))
        _scatter_chunk(_chunk_experts(topk_ptr, c, N, E, CHUNK), base, c, sorted_ids_ptr, expert_ids_ptr,
                       E, BLOCK_M, CHUNK, W)
        # experts c*EPP .. c*EPP+EPP-1: the sentinel N into their padding rows, one [EPP, BLOCK_M] store
        e = c * EPP + tl.arange(0, EPP)[:, None]
        j = tl.arange(0, BLOCK_M)[None, :]
        start = tl.load(runs_ptr + e, mask=e < E, other=0)
        count = tl.load(runs_ptr + W + e, mask=e < E, other=0)
        pad = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M - count
        tl.store(sorted_ids_ptr + start + count + j, tl.zeros([EPP, BLOCK_M], dtype=tl.int32) + N,
                 mask=(e < E) & (j < pad))

    # ------------------------------------------------------------------ the previous align (scan)

    @triton.jit
    def _count_kernel(topk_ptr, counts_ptr, N, CH: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        e = tl.program_id(0)
        acc = tl.zeros([CH], dtype=tl.int32)
        for c in range(0, N, CH):
            offs = c + tl.arange(0, CH)
            ids = tl.load(topk_ptr + offs, mask=offs < N, other=-1)
            acc += (ids == e).to(tl.int32)
        tl.store(counts_ptr + e, tl.sum(acc, axis=0))

    @triton.jit
    def _align_kernel(topk_ptr, counts_ptr, sorted_ids_ptr, expert_ids_ptr, total_ptr, N, E,
                      BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CH: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        e = tl.program_id(0)
        offs_e = tl.arange(0, E_P2)
        cnt = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0)
        padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        excl = tl.cumsum(padded, axis=0) - padded
        start = tl.sum(tl.where(offs_e == e, excl, 0), axis=0)
        my_cnt = tl.sum(tl.where(offs_e == e, cnt, 0), axis=0)
        my_pad = (my_cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        if e == 0:
            tl.store(total_ptr, tl.sum(padded, axis=0))
        if my_cnt > 0:
            running = tl.sum(tl.zeros([CH], dtype=tl.int32), axis=0)
            for c in range(0, N, CH):
                offs = c + tl.arange(0, CH)
                ids = tl.load(topk_ptr + offs, mask=offs < N, other=-1)
                hit = (ids == e).to(tl.int32)
                rank = running + tl.cumsum(hit, axis=0) - hit
                tl.store(sorted_ids_ptr + start + rank, offs, mask=hit > 0)
                running += tl.sum(hit, axis=0)
            offs_p = tl.arange(0, BLOCK_M)
            sentinel = tl.zeros([BLOCK_M], dtype=tl.int32) + N
            tl.store(sorted_ids_ptr + start + my_cnt + offs_p, sentinel, mask=my_cnt + offs_p < my_pad)
            nblk = my_pad // BLOCK_M
            b0 = start // BLOCK_M
            for b in range(0, nblk, CH):
                ob = b + tl.arange(0, CH)
                tl.store(expert_ids_ptr + b0 + ob, tl.zeros([CH], dtype=tl.int32) + e, mask=ob < nblk)


def _align_buffers(topk_idx: torch.Tensor, num_experts: int, block_m: int):
    flat = topk_idx.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    rows = max_padded_rows(flat.numel(), num_experts, block_m)
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=flat.device)
    expert_ids = torch.empty(rows // block_m, dtype=torch.int32, device=flat.device)
    total = torch.empty(1, dtype=torch.int32, device=flat.device)
    return flat, sorted_ids, expert_ids, total


def moe_align(topk_idx: torch.Tensor, num_experts: int, block_m: int, chunk: int | None = None,
              warps: int | None = None):
    """-> (sorted_ids int32 [R], expert_ids int32 [R/block_m], total int32 [1]); only the first
    `total` rows are written (padding rows hold the sentinel T*K). chunk: slots per program
    (a power of two; default: `default_chunk`); warps: the
    single program's warps (benchmarks; the rows are the same whatever chunk and warps are)."""
    flat, sorted_ids, expert_ids, total = _align_buffers(topk_idx, num_experts, block_m)
    n = flat.numel()
    width = _next_pow2(num_experts + 1)  # one bin per expert plus "nowhere"
    if chunk is None:
        chunk = default_chunk(n, block_m)
    assert chunk == _next_pow2(chunk), chunk
    if n <= chunk:
        _single_chunk_align_kernel[(1,)](flat, sorted_ids, expert_ids, total, n, num_experts,
                                         BLOCK_M=block_m, CHUNK=chunk, W=width,
                                         num_warps=warps or (4 if chunk <= 1024 else 8), **pdl_launch())
        return sorted_ids, expert_ids, total
    num_chunks = _cdiv(n, chunk)
    chunk_counts = torch.empty(num_chunks, width, dtype=torch.int32, device=flat.device)
    base = torch.empty_like(chunk_counts)
    runs = torch.empty(2, width, dtype=torch.int32, device=flat.device)
    _chunk_hist_kernel[(num_chunks,)](flat, chunk_counts, n, num_experts, CHUNK=chunk, W=width, num_warps=4,
                                      **pdl_launch())
    _chunk_scan_kernel[(1,)](chunk_counts, base, runs, total, num_chunks, BLOCK_M=block_m, W=width,
                             CB=min(32, _next_pow2(num_chunks)), num_warps=8, **pdl_launch())
    _chunk_scatter_kernel[(num_chunks,)](flat, base, runs, sorted_ids, expert_ids, n, num_experts,
                                         BLOCK_M=block_m, CHUNK=chunk, W=width,
                                         EPP=_next_pow2(_cdiv(num_experts, num_chunks)), num_warps=4, **pdl_launch())
    return sorted_ids, expert_ids, total


def moe_align_scan(topk_idx: torch.Tensor, num_experts: int, block_m: int):
    """The previous align, same outputs as `moe_align`: grid E, each program scans every slot."""
    flat, sorted_ids, expert_ids, total = _align_buffers(topk_idx, num_experts, block_m)
    n = flat.numel()
    counts = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
    ch = 1024 if n > 256 else 256
    _count_kernel[(num_experts,)](flat, counts, n, CH=ch, num_warps=4, **pdl_launch())
    _align_kernel[(num_experts,)](flat, counts, sorted_ids, expert_ids, total, n, num_experts,
                                  BLOCK_M=block_m, E_P2=_next_pow2(num_experts), CH=ch, num_warps=4, **pdl_launch())
    return sorted_ids, expert_ids, total
