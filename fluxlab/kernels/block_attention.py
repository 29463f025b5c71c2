"""Paged block-causal attention with no host plan (Triton).

FlashInfer plans every batch on the host: ~0.37 ms at 18 query blocks and ~0.9-1.0 ms at 64-72
(measured on H200, docs/benchmarks.md §16), paid on every step of the dynamic policy, whose rows
enter and leave blocks at different steps, and on paged's block-boundary steps. Here one program
owns one query block and the query heads of one KV head (`heads_per_program`), reads its request's
page table and page count from device memory and walks pages 0 .. its block with an online softmax,
so the host only copies two small tables (none at all when the rows repeat) and a CUDA graph replays
any mix of rows.

Every query block has exactly block_length queries (a segment, layers/segments.py) and attends
bidirectionally to every key of its pages: pages before its own hold final blocks, its own page its
current tokens (the block-causal rule). No key is split across programs, so a block's output does
not depend on what else is in the batch. fp32 inputs use IEEE dot products (the CPU parity tests
run the sdpa backend; this kernel matches it to fp32 rounding under the interpreter).

FP8 pages (float8_e4m3fn, engine/layers/kv_fp8.py): the kernel loads e4m3 keys and values and
dequantizes them in registers, (stored * scale) in fp32 rounded to q's dtype, as the sdpa path's
`dequantize_kv` does before its gather, so a page costs half the bytes and the dots see the same numbers.
"""
from __future__ import annotations

import torch

from fluxlab.kernels.fused_norm import HAVE_TRITON, tl, triton
from fluxlab.kernels.pdl import launch as pdl_launch, start as pdl_start

if HAVE_TRITON:
    @triton.jit
    def _block_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, used_ptr,
                                stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_ot, stride_oh,
                                stride_table, scale_log2, group, k_scale, v_scale,
                                BL: tl.constexpr, BM: tl.constexpr, PACK: tl.constexpr, D: tl.constexpr,
                                PAGES: tl.constexpr, IEEE: tl.constexpr, KV_FP8: tl.constexpr,
                                PDL: tl.constexpr = False):
        # One program: one query block and PACK query heads of one KV head, stacked as PACK * BM rows
        # (head-major), so each key page is loaded once for the heads that share it and the dots are
        # PACK times taller. Each step of the softmax takes PAGES pages' keys (PAGES * BM columns):
        # fewer dependent steps for a program that walks a long context alone.
        pdl_start(PDL)
        segment = tl.program_id(0)
        first_head = tl.program_id(1) * PACK
        kv_head = first_head // group
        rows = tl.arange(0, PACK * BM)
        token = rows % BM  # BM >= 16 for tl.dot; tokens past the block are masked
        head = first_head + rows // BM
        row_ok = token < BL
        dims = tl.arange(0, D)
        q = tl.load(q_ptr + (segment * BL + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        num_pages = tl.load(used_ptr + segment) // BL
        run_max = tl.full([PACK * BM], -float("inf"), dtype=tl.float32)
        run_sum = tl.zeros([PACK * BM], dtype=tl.float32)
        acc = tl.zeros([PACK * BM, D], dtype=tl.float32)
        cols = tl.arange(0, PAGES * BM)
        slots = cols % BM  # keys of a page: the same BL slots as the queries of a block
        for first in range(0, num_pages, PAGES):
            # page `first` always exists, so every step has a finite score per row (no NaN below)
            p = first + cols // BM
            page_ok = p < num_pages
            key_ok = page_ok & (slots < BL)
            page = tl.load(table_ptr + segment * stride_table + p, mask=page_ok, other=0).to(tl.int64)
            at = page[:, None] * stride_kp + slots[:, None] * stride_kt + kv_head * stride_kh + dims[None, :]
            keys = tl.load(k_ptr + at, mask=key_ok[:, None], other=0.0)
            if KV_FP8:
                keys = (keys.to(tl.float32) * k_scale).to(q.dtype)
            if IEEE:
                scores = tl.dot(q, tl.trans(keys), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(keys))
            scores = tl.where(key_ok[None, :], scores * scale_log2, -float("inf"))
            new_max = tl.maximum(run_max, tl.max(scores, axis=1))
            alpha = tl.exp2(run_max - new_max)
            probs = tl.exp2(scores - new_max[:, None])
            run_sum = run_sum * alpha + tl.sum(probs, axis=1)
            values = tl.load(v_ptr + at, mask=key_ok[:, None], other=0.0)
            if KV_FP8:
                values = (values.to(tl.float32) * v_scale).to(q.dtype)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(probs.to(values.dtype), values, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(probs.to(values.dtype), values)
            run_max = new_max
        out = acc / run_sum[:, None]
        tl.store(out_ptr + (segment * BL + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def heads_per_program(group: int, block_m: int) -> int:
    """Query heads one program stacks: the KV group when it is a power of two and the stack stays
    within 128 rows, else 1 (a program per query head)."""
    return group if group & (group - 1) == 0 and group * block_m <= 128 else 1


# Key pages per softmax step. H200, LLaDA2.0-mini heads, blocks of 32, us per call for 1 / 2 / 4 pages
# (docs/benchmarks.md §22): batch 1 at 9 pages 12.2 / 10.9 / 13.7, at 32 pages 36.2 / 28.5 / 30.8;
# batch 64 at 9 pages 23.6 / 22.4 / 35.4. Four pages' [128, 128] score tile costs more than it saves.
PAGES_PER_STEP = 2


def block_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                    used_tokens: torch.Tensor, scale: float, pack: int | None = None,
                    pages_per_step: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """out [S * bl, Hq, D] for q [S * bl, Hq, D] (S query blocks of bl tokens), one layer's pages
    k_cache / v_cache [P, bl, Hkv, D], page_table [S, W] int32 (each block's request's pages) and
    used_tokens [S] int32 = (block + 1) * bl: the keys block s attends to are pages 0 .. block.
    pack: query heads per program (default `heads_per_program`; 1 is a program per head);
    pages_per_step: key pages per softmax step, a power of two (default PAGES_PER_STEP);
    k_scale / v_scale: float8_e4m3fn pages hold values / scale (other pages are q's dtype, scale 1)."""
    num_pages, bl, num_kv_heads, head_dim = k_cache.shape
    tokens, num_heads, _ = q.shape
    segments = tokens // bl
    if tokens != segments * bl or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} is not whole blocks of {bl} with a multiple of {num_kv_heads} heads")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim={head_dim}: the kernel needs a power of two >= 16")
    kv_fp8 = k_cache.dtype == torch.float8_e4m3fn
    if v_cache.dtype != k_cache.dtype or not (kv_fp8 or k_cache.dtype == q.dtype):
        raise ValueError(f"K/V pages of {k_cache.dtype} / {v_cache.dtype} for q of {q.dtype}: need q's dtype or "
                         "float8_e4m3fn")
    if not kv_fp8 and (k_scale, v_scale) != (1.0, 1.0):
        raise ValueError(f"k_scale={k_scale}, v_scale={v_scale}: scales are for float8_e4m3fn pages only")
    q = q.contiguous()
    out = torch.empty_like(q)
    if segments == 0:
        return out
    block_m = max(16, triton.next_power_of_2(bl))
    group = num_heads // num_kv_heads
    pack = heads_per_program(group, block_m) if pack is None else pack
    if pack < 1 or group % pack:
        raise ValueError(f"pack={pack} must divide the {group} query heads of a KV head")
    pages = PAGES_PER_STEP if pages_per_step is None else pages_per_step
    if pages < 1 or pages & (pages - 1):
        raise ValueError(f"pages_per_step={pages} must be a power of two")
    _block_attention_kernel[(segments, num_heads // pack)](
        q, k_cache, v_cache, out, page_table, used_tokens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), page_table.stride(0), scale * 1.4426950408889634, group, k_scale, v_scale,
        BL=bl, BM=block_m, PACK=pack, D=head_dim, PAGES=pages, IEEE=q.dtype == torch.float32, KV_FP8=kv_fp8,
        num_warps=4, num_stages=2, **pdl_launch())
    return out
