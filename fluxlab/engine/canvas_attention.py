"""Paged attention for Diffusion-Gemma's mixed forward: encoder tokens write K/V, canvas tokens read.

Pages are per layer, each layer with its own K/V shape (sliding layers: head_dim / KV heads of the
text config; full layers: global_head_dim / num_global_key_value_heads); a page holds one canvas
(page size = canvas length) of every layer. A row of a forward is one request's encoder tokens
(prompt chunk or committed canvas, causal) then maybe its canvas (bidirectional over the cached
prefix + itself, no K/V written). Per layer: the encoder tokens' K/V go to their pages first, then
each row attends over its cached keys plus its own canvas keys, which come straight from this
forward. Masks, the same for every layer of a type (what DenseCanvasAttention computes):
- encoder query at p: keys at positions <= p; sliding layers only the last `window` of them;
- canvas query: every prefix key and the whole canvas; sliding layers only the last window - 1
  prefix keys (what transformers' DynamicSlidingWindowLayer keeps).
Every page of a request is kept for every layer (a sliding layer's pages older than its window are
never read but still held; see docs in canvas_runner.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


class CanvasKVCache:
    """K and V pools per layer: [num_pages * page_size, kv_heads_l, head_dim_l] (flat slots)."""

    def __init__(self, shapes: list[tuple[int, int]], num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.page_size = page_size
        self.k = [torch.zeros(num_pages * page_size, h, d, dtype=dtype, device=device) for h, d in shapes]
        self.v = [torch.zeros(num_pages * page_size, h, d, dtype=dtype, device=device) for h, d in shapes]

    @staticmethod
    def bytes_per_page(shapes: list[tuple[int, int]], page_size: int, dtype: torch.dtype) -> int:
        return 2 * page_size * sum(h * d for h, d in shapes) * torch.finfo(dtype).bits // 8


@dataclass
class CanvasRow:
    """One request's part of a forward, in absolute positions (the runner's host view)."""

    key_slots: np.ndarray  # [K] cache slots of positions 0..K-1 (cached + this forward's encoder tokens)
    encoder_tokens: np.ndarray  # flat token indices of its encoder tokens (positions K - len .. K-1)
    canvas_tokens: np.ndarray  # flat token indices of its canvas (positions K .. K+L-1), or empty


@dataclass
class CanvasAttentionMetadata:
    write_slots: torch.Tensor  # [Te] slots of every encoder token
    write_tokens: torch.Tensor  # [Te] their flat token indices
    key_slots: torch.Tensor  # [R, K] padded cache slots of each row's prefix keys
    canvas_gather: torch.Tensor  # [R, L] flat token index of each row's canvas keys (0 where none)
    query_gather: torch.Tensor  # [R, Q] flat token index of each row's queries (0 = padding)
    query_scatter: torch.Tensor  # [T] index of each flat token in the padded [R * Q] queries
    masks: dict[bool, torch.Tensor]  # sliding? -> [R, 1, Q, K + L] True = may attend


def build_canvas_metadata(rows: list[CanvasRow], canvas_length: int, window: int,
                          device: torch.device) -> CanvasAttentionMetadata:
    num_rows = len(rows)
    L = canvas_length
    max_k = max(len(r.key_slots) for r in rows)
    queries = [np.concatenate([r.encoder_tokens, r.canvas_tokens]) for r in rows]
    max_q = max(len(q) for q in queries)
    key_slots = np.zeros((num_rows, max_k), dtype=np.int64)
    canvas_gather = np.zeros((num_rows, L), dtype=np.int64)
    query_gather = np.zeros((num_rows, max_q), dtype=np.int64)
    masks = {s: np.zeros((num_rows, max_q, max_k + L), dtype=bool) for s in (False, True)}
    scatter = []
    key_pos = np.arange(max_k)
    for i, (row, q) in enumerate(zip(rows, queries)):
        k = len(row.key_slots)
        key_slots[i, :k] = row.key_slots
        query_gather[i, :len(q)] = q
        scatter.append(i * max_q + np.arange(len(q)))
        ne = len(row.encoder_tokens)
        # encoder queries sit at positions k - ne .. k - 1
        q_pos = np.arange(k - ne, k)[:, None]
        causal = (key_pos[None, :] <= q_pos) & (key_pos[None, :] < k)
        masks[False][i, :ne, :max_k] = causal
        masks[True][i, :ne, :max_k] = causal & (key_pos[None, :] > q_pos - window)
        if len(row.canvas_tokens):
            canvas_gather[i] = row.canvas_tokens
            rows_c = slice(ne, ne + L)
            masks[False][i, rows_c, :k] = True
            masks[True][i, rows_c, max(0, k - (window - 1)):k] = True
            masks[False][i, rows_c, max_k:] = True
            masks[True][i, rows_c, max_k:] = True
        for m in masks.values():
            m[i, len(q):, 0] = True  # padded queries see one key so softmax stays finite
    write_slots = np.concatenate([r.key_slots[len(r.key_slots) - len(r.encoder_tokens):] for r in rows])
    write_tokens = np.concatenate([r.encoder_tokens for r in rows])

    def dev(a):
        return torch.from_numpy(a).to(device, non_blocking=True)

    return CanvasAttentionMetadata(dev(write_slots), dev(write_tokens), dev(key_slots), dev(canvas_gather),
                                   dev(query_gather), dev(np.concatenate(scatter)),
                                   {s: dev(m)[:, None] for s, m in masks.items()})


class PagedCanvasAttention:
    """The model's `attn.forward(layer_idx, q, k, v)` over a CanvasKVCache (torch sdpa)."""

    def __init__(self, cache: CanvasKVCache, layer_is_sliding: list[bool]):
        self.cache = cache
        self.layer_is_sliding = layer_is_sliding
        self.meta: CanvasAttentionMetadata | None = None

    def begin(self, meta: CanvasAttentionMetadata) -> None:
        self.meta = meta

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        cache_k, cache_v = self.cache.k[layer_idx], self.cache.v[layer_idx]
        if meta.write_slots.numel():
            cache_k[meta.write_slots] = k[meta.write_tokens]
            cache_v[meta.write_slots] = v[meta.write_tokens]
        keys = torch.cat([cache_k[meta.key_slots], k[meta.canvas_gather]], dim=1)  # [R, K + L, Hkv, D]
        values = torch.cat([cache_v[meta.key_slots], v[meta.canvas_gather]], dim=1)
        queries = q[meta.query_gather]  # [R, Q, H, D]
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=meta.masks[self.layer_is_sliding[layer_idx]], scale=1.0, enable_gqa=True)
        return out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])[meta.query_scatter]
