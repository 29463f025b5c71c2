"""Diffusion-Gemma's canvas attention in one batch-invariant Triton kernel (replaces gather + cat + sdpa).

A row of a canvas forward is one request: E encoder queries (a prompt chunk or the canvas it commits,
causal, at positions K - E .. K - 1) then maybe its canvas (L queries, bidirectional over its prefix
and the whole canvas). Its keys, in this order: the L canvas keys (flat token indices, `canvas_index`)
then its prefix keys, key p at position `first + p` (cache slots `prefix_slots`; a sliding layer's
keys written by this very forward come from the forward, `fresh`). The masks are the torch path's
(diffusion_gemma/paged_attention.py `_masks`, static.py `plan`), computed here from four numbers a row
(`geometry`): K (prefix keys, positions 0..K-1), E, queries, first:
- encoder query at q = K - E + i: prefix keys at p <= q; sliding layers only p > q - window;
- canvas query: the whole canvas and every prefix key; sliding layers only p >= K - (window - 1).
Softmax scale as given (Diffusion-Gemma: 1; no attention soft-cap).

One program per (query tile of BLOCK_M queries, query head, row); it reads its KV head (GQA) and walks
the canvas keys, then the prefix keys, in blocks of BLOCK_N at fixed offsets from the row's first key,
with an online softmax. Nothing a program computes depends on another row, on the batch's padding
(`prefix_slots` wider than this row's keys) or on where the row's tokens sit in the flat batch; a block
that a tile skips (past its last causal key, before the window) would only have added exact zeros
(alpha = 1, p = 0), so which blocks a tile walks changes no bit of a row. Tile sizes come from the head
dim (`CONFIGS`; smaller, once, where the device refuses them for a dtype), and a grid of many query tiles
takes a taller query tile over the same key blocks (`TALL_TILES`: the same bits).
fp32 inputs use IEEE dots (the interpreter tests compare with torch's sdpa to fp32 rounding); bf16 dots
accumulate in fp32 with P rounded to bf16 (flash attention's numerics). A query that sees no key (a graph's dummy rows only) gets zeros.
CUDA (or TRITON_INTERPRET=1, the tests).
"""
from __future__ import annotations

import json
import os

import torch

from fluxlab.kernels.fused_norm import HAVE_TRITON, _next_pow2, tl, triton
from fluxlab.kernels.pdl import launch as pdl_launch, start as pdl_start

if HAVE_TRITON:
    from triton.runtime.errors import OutOfResources
else:
    OutOfResources = RuntimeError

# (BLOCK_M, BLOCK_N, warps, stages) by padded head dim (TALL_TILES below: a taller BLOCK_M for big grids).
# 26B-A4B: sliding layers 256, full layers 512 (acc [64, 512] fp32 = 128 registers a thread at 8 warps; K and V
# blocks [32, 512] bf16 = 64 KiB a stage). FLUXLAB_CANVAS_ATTENTION_CONFIG='{"512": [64, 32, 8, 2]}' overrides
# entries for a sweep. A config's key block changes the summation order: one a head dim, never per batch. H200
# sweep, 2026-12-04 (benchmarks/device/diffusion_gemma_attention_tiles.py,
# docs/benchmarks/2026-12-04_h200_canvas_attention_tiles.txt): these are the fastest configs that keep their bits
# at 1, 2 and 16 canvases; query tiles of 32 or 16 rows (another MMA instruction than 64-row tiles, another
# layout for the softmax's row sums) changed bits against them. fp32 operands take twice the shared memory: on an
# H200 fp32 at 256 and 512 needs 459 and 271 KiB of the 227 KiB a block may have, so a launch the device refuses
# steps down (`_smaller`) once per (head dim, dtype, device) and keeps what fitted: still one config per engine,
# whatever the batch. The full layers' 512 take 3 stages since EVEN_D dropped the dims mask (fewer spills): one H100,
# 2026-12-07, the kernel as the denoiser graphs run it (no fresh keys; dg_kernel_probe.py attention), 0.098 -> 0.081 ms
# a layer at one canvas and 0.837 -> 0.680 at 16, the same bits (the key block is unchanged).
CONFIGS: dict[int, tuple[int, int, int, int]] = {16: (64, 64, 4, 2), 32: (64, 64, 4, 2), 64: (64, 64, 4, 2),
                                                 128: (64, 64, 4, 2), 256: (64, 64, 8, 2), 512: (64, 32, 8, 3)}


# Many query tiles (16 canvases: 1024 programs of 64 queries at 26B-A4B shapes): 128-query tiles for the sliding
# layers' head dim, in half precision. The same key blocks in the same order on the same warpgroup MMA,
# so the same bits as the table's tile: equal outputs at 1 and 16 canvases on one H100, 2026-12-07
# (benchmarks/device/dg_kernel_probe.py attention), and at 1, 2 and 16 with 2 stages in the H200 sweep above.
# There 0.462 -> 0.346 ms a sliding layer at 16 canvases, but 0.057 -> 0.070 at one (fewer programs than SMs):
# hence by grid size. The full layers' 512 keep theirs (128-query tiles 4x slower). End to end on that H100 the
# bf16 denoise step at 16 canvases went 97.2 -> 95.6-95.9 ms; tests/test_canvas_attention.py's tall-tile GPU test
# checks the bits (docs/benchmarks.md, 2026-12-07, fifth session). Two stages since EVEN_D (no spills at 128 x 64
# without fresh keys, the graphs' path): 0.339 -> 0.225 ms a sliding layer at 16 canvases on one H100 (eighth session).
TALL_TILES: dict[int, tuple[int, int, int, int]] = {256: (128, 64, 8, 2)}
TALL_FROM_PROGRAMS = 1024


def tile_config(config: tuple[int, int, int, int], padded: int, dtype: torch.dtype, query_tiles: int
                ) -> tuple[int, int, int, int]:
    """The launch's (BLOCK_M, BLOCK_N, warps, stages) for the table's `config` (`config_for`, or what fitted):
    TALL_TILES's tile where it keeps the key block and the table's grid has `query_tiles` >= TALL_FROM_PROGRAMS
    programs (half precision; no FLUXLAB_CANVAS_ATTENTION_CONFIG), else `config`."""
    tall = TALL_TILES.get(padded)
    if (tall and tall[1] == config[1] and dtype in (torch.bfloat16, torch.float16) and query_tiles >= TALL_FROM_PROGRAMS
            and not os.environ.get("FLUXLAB_CANVAS_ATTENTION_CONFIG")):
        return tall
    return config


def _smaller(config: tuple[int, int, int, int]) -> tuple[int, int, int, int] | None:
    """The next config to try when `config` does not fit: one stage, then half the key block, then half
    the query block (16 is tl.dot's least)."""
    block_m, block_n, warps, stages = config
    if stages > 1:
        return block_m, block_n, warps, 1
    if block_n > 16:
        return block_m, block_n // 2, warps, 1
    if block_m > 16:
        return block_m // 2, block_n, min(warps, 4), 1
    return None


_FITTED: dict[tuple[int, torch.dtype, torch.device], tuple[int, int, int, int]] = {}
_NO_TALL: set[tuple[int, torch.dtype, torch.device]] = set()  # where TALL_TILES did not fit


def config_for(head_dim: int) -> tuple[int, int, int, int]:
    padded = max(16, _next_pow2(head_dim))
    table = dict(CONFIGS)
    env = os.environ.get("FLUXLAB_CANVAS_ATTENTION_CONFIG")
    if env:
        table.update({int(k): tuple(v) for k, v in json.loads(env).items()})
    if padded not in table:
        raise ValueError(f"head_dim={head_dim}: no canvas attention tile config for {padded}")
    return table[padded]


if HAVE_TRITON:
    @triton.jit
    def _attend(q, keys, values, visible, run_max, run_sum, acc, scale_log2, IEEE: tl.constexpr):
        """One block of the online softmax. Invisible scores are -inf; a row that has seen no key yet
        keeps max -inf and subtracts 0 instead (no inf - inf), so its alpha and p are exact zeros."""
        if IEEE:
            scores = tl.dot(q, tl.trans(keys), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(keys))
        scores = tl.where(visible, scores * scale_log2, -float("inf"))
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == -float("inf"), 0.0, new_max)
        alpha = tl.exp2(run_max - safe_max)
        probs = tl.exp2(scores - safe_max[:, None])
        run_sum = run_sum * alpha + tl.sum(probs, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(probs, values, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(probs.to(values.dtype), values)
        return new_max, run_sum, acc

    @triton.jit(do_not_specialize=["num_slots", "stride_query", "stride_slots", "stride_fresh", "stride_geom"])
    def _canvas_attention_kernel(q_ptr, k_ptr, v_ptr, ck_ptr, cv_ptr, out_ptr, query_ptr, canvas_ptr, slots_ptr,
                                 fresh_ptr, geom_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                                 stride_vh, stride_ct, stride_ch, stride_cvt, stride_cvh, stride_ot, stride_oh,
                                 stride_query, stride_canvas, stride_slots, stride_fresh, stride_geom, num_slots,
                                 canvas_length, head_dim, group, window, scale_log2,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DP: tl.constexpr,
                                 SLIDING: tl.constexpr, HAS_FRESH: tl.constexpr, IEEE: tl.constexpr,
                                 EVEN_D: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        tile = tl.program_id(0)
        head = tl.program_id(1)
        row = tl.program_id(2).to(tl.int64)
        kv_head = head // group
        # (int32 from here: counts and positions; token and slot offsets are widened where they are used)
        num_keys = tl.load(geom_ptr + row).to(tl.int32)  # K: the row's prefix keys are positions 0 .. K-1
        num_encoder = tl.load(geom_ptr + stride_geom + row).to(tl.int32)
        num_queries = tl.load(geom_ptr + 2 * stride_geom + row).to(tl.int32)
        first = tl.load(geom_ptr + 3 * stride_geom + row).to(tl.int32)  # position of prefix key 0
        lo_q = tile * BLOCK_M
        i = lo_q + tl.arange(0, BLOCK_M)
        q_ok = i < num_queries
        dims = tl.arange(0, DP)
        if EVEN_D:  # head_dim == DP: no dims mask (fewer registers and instructions on sm90; the same values)
            d_ok = dims < DP
        else:
            d_ok = dims < head_dim
        token = tl.load(query_ptr + row * stride_query + i, mask=q_ok, other=0).to(tl.int64)
        q = tl.load(q_ptr + token[:, None] * stride_qt + head * stride_qh + dims[None, :],
                    mask=q_ok[:, None] & d_ok[None, :], other=0.0)
        is_encoder = i < num_encoder
        is_canvas = q_ok & (i >= num_encoder)
        q_pos = num_keys - num_encoder + i  # an encoder query's position
        run_max = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
        run_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DP], dtype=tl.float32)
        hi_q = tl.minimum(lo_q + BLOCK_M, num_queries)  # queries lo_q .. hi_q - 1 are real
        has_canvas = (hi_q > num_encoder) & (lo_q < hi_q)
        has_encoder = lo_q < tl.minimum(num_encoder, hi_q)

        # the canvas keys (only canvas queries see them)
        canvas_end = tl.where(has_canvas, canvas_length, 0)
        for start in range(0, canvas_end, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            k_ok = j < canvas_length
            src = tl.load(canvas_ptr + row * stride_canvas + j, mask=k_ok, other=0).to(tl.int64)
            at_ok = k_ok[:, None] & d_ok[None, :]
            keys = tl.load(k_ptr + src[:, None] * stride_kt + kv_head * stride_kh + dims[None, :], mask=at_ok,
                           other=0.0)
            values = tl.load(v_ptr + src[:, None] * stride_vt + kv_head * stride_vh + dims[None, :], mask=at_ok,
                             other=0.0)
            visible = is_canvas[:, None] & k_ok[None, :]
            run_max, run_sum, acc = _attend(q, keys, values, visible, run_max, run_sum, acc, scale_log2, IEEE)

        # the prefix keys: p = 0 .. min(K - first, num_slots) - 1, at position first + p
        num_prefix = tl.minimum(num_keys - first, num_slots)
        last_encoder = num_keys - num_encoder + tl.minimum(num_encoder, hi_q) - 1  # the tile's last encoder position
        prefix_end = tl.where(has_canvas, num_prefix,
                              tl.where(has_encoder, tl.minimum(num_prefix, last_encoder - first + 1), 0))
        prefix_start = 0
        if SLIDING:  # the oldest key a query of the tile sees, rounded down to a block of the row's fixed grid
            oldest = tl.where(has_canvas, num_keys - (window - 1), num_keys)
            oldest = tl.where(has_encoder, tl.minimum(oldest, num_keys - num_encoder + lo_q - window + 1), oldest)
            prefix_start = (tl.maximum(oldest - first, 0) // BLOCK_N) * BLOCK_N
        for start in range(prefix_start, prefix_end, BLOCK_N):
            p = start + tl.arange(0, BLOCK_N)
            p_ok = p < num_prefix
            slot = tl.load(slots_ptr + row * stride_slots + p, mask=p_ok, other=0).to(tl.int64)
            key_rows = ck_ptr + slot * stride_ct + kv_head * stride_ch
            value_rows = cv_ptr + slot * stride_cvt + kv_head * stride_cvh
            if HAS_FRESH:  # keys this forward writes: from the forward (the ring slot may hold an older block)
                fresh = tl.load(fresh_ptr + row * stride_fresh + p, mask=p_ok, other=-1).to(tl.int64)
                # one gather from either source per key row (not a load from each and a select per element)
                key_rows = tl.where(fresh >= 0, k_ptr + fresh * stride_kt + kv_head * stride_kh, key_rows)
                value_rows = tl.where(fresh >= 0, v_ptr + fresh * stride_vt + kv_head * stride_vh, value_rows)
            at_ok = p_ok[:, None] & d_ok[None, :]
            keys = tl.load(key_rows[:, None] + dims[None, :], mask=at_ok, other=0.0)
            values = tl.load(value_rows[:, None] + dims[None, :], mask=at_ok, other=0.0)
            key_pos = (first + p)[None, :]
            encoder_sees = key_pos <= q_pos[:, None]
            canvas_sees = p_ok[None, :]
            if SLIDING:
                encoder_sees = encoder_sees & (key_pos > q_pos[:, None] - window)
                canvas_sees = canvas_sees & (key_pos >= num_keys - (window - 1))
            visible = p_ok[None, :] & tl.where(is_encoder[:, None], encoder_sees, is_canvas[:, None] & canvas_sees)
            run_max, run_sum, acc = _attend(q, keys, values, visible, run_max, run_sum, acc, scale_log2, IEEE)

        out = acc / tl.where(run_sum > 0, run_sum, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_ok[:, None] & d_ok[None, :])


def canvas_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                     cache_v: torch.Tensor, query_index: torch.Tensor, canvas_index: torch.Tensor,
                     prefix_slots: torch.Tensor, geometry: torch.Tensor, window: int = 0,
                     fresh: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """out [T, H, D] for the forward's flat q [T, H, D] and k / v [T, Hkv, D], one layer's pools
    cache_k / cache_v [slots, Hkv, D], per row r of R:
    query_index [R, Q]: flat token of its i-th query (encoder queries first; past its count: anything);
    canvas_index [R, L]: flat token of its canvas keys (read only by rows with canvas queries);
    prefix_slots [R, Kt]: pool slot of its prefix key p (position first + p; past its keys: anything);
    geometry [4, R] int64: K (prefix keys), E (encoder queries), queries, first (0 for full layers);
    window: the sliding window (0: a full-attention layer);
    fresh [R, Kt] or None: flat token of a prefix key this forward computed (read from k / v), -1: the pool's.
    Every flat token must be some row's query (out is not cleared)."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    for name, t in (("k", k), ("v", v), ("cache_k", cache_k), ("cache_v", cache_v)):
        if t.shape[1:] != (num_kv_heads, head_dim) or t.stride(2) != 1:
            raise ValueError(f"{name} {tuple(t.shape)}: want [*, {num_kv_heads}, {head_dim}], last dim contiguous")
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    rows, max_queries = query_index.shape
    if rows == 0 or tokens == 0:
        return out
    padded = max(16, _next_pow2(head_dim))
    canvas_length = canvas_index.shape[1]
    slots = prefix_slots if prefix_slots.shape[1] else torch.zeros(rows, 1, dtype=torch.long, device=q.device)
    num_slots = prefix_slots.shape[1]
    fresh_t = fresh if fresh is not None else slots
    key = (padded, q.dtype, q.device)
    table_config = _FITTED.get(key) or config_for(head_dim)
    config = table_config if key in _NO_TALL else tile_config(
        table_config, padded, q.dtype, triton.cdiv(max_queries, table_config[0]) * num_heads * rows)
    is_tall = config != table_config
    first_choice = config
    while True:
        block_m, block_n, warps, stages = config
        grid = (triton.cdiv(max_queries, block_m), num_heads, rows)
        try:
            _canvas_attention_kernel[grid](
                q, k, v, cache_k, cache_v, out, query_index, canvas_index, slots, fresh_t, geometry,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cache_k.stride(0),
                cache_k.stride(1), cache_v.stride(0), cache_v.stride(1), out.stride(0), out.stride(1),
                query_index.stride(0), canvas_index.stride(0), slots.stride(0), fresh_t.stride(0),
                geometry.stride(0), num_slots, canvas_length, head_dim, num_heads // num_kv_heads, window,
                scale * 1.4426950408889634, BLOCK_M=block_m, BLOCK_N=block_n, DP=padded, SLIDING=window > 0,
                HAS_FRESH=fresh is not None, IEEE=q.dtype == torch.float32, EVEN_D=head_dim == padded,
                num_warps=warps, num_stages=stages, **pdl_launch())
        except OutOfResources:  # raised before the launch: nothing ran, try the next smaller tiles
            if is_tall:  # the table's tile, never a smaller key block (other bits)
                _NO_TALL.add(key)
                config, is_tall, first_choice = table_config, False, table_config
                continue
            config = _smaller(config)
            if config is None:
                raise
            continue
        if config != first_choice:
            _FITTED[key] = config  # the table's entry does not fit this device: skip the failed compiles
        return out
