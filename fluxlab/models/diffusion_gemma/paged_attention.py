"""Paged attention for Diffusion-Gemma's mixed forward: encoder tokens write K/V, canvas tokens read.

Two page pools (canvas_pages.py): full-attention layers keep a page per canvas (global_head_dim /
num_global_key_value_heads); sliding layers (head_dim / KV heads of the text config) keep a ring of
ceil(window / L) + 1 pages per request. A row of a forward is one request's encoder tokens (prompt
chunk or committed canvas, causal) then maybe its canvas (bidirectional over the cached prefix +
itself, no K/V written). Masks, the same for every layer of a type (what DenseCanvasAttention computes):
- encoder query at p: keys at positions <= p; sliding layers only the last `window` of them;
- canvas query: every prefix key and the whole canvas; sliding layers only the last window - 1
  prefix keys (what transformers' DynamicSlidingWindowLayer keeps).
Full layers write their encoder K/V to their pages, then gather every prefix key. Sliding layers
gather first: keys written by an earlier forward from the ring, this forward's encoder keys (and
the canvas) straight from the forward; then they write only the blocks a later query can see, so
a ring slot is reused only once no query reads its old block (a failed step's clobbered slots are
put back by the runner: `CanvasKVCache.save_sliding`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


class CanvasKVCache:
    """K and V pools per layer: [pages * page_size, kv_heads_l, head_dim_l] (flat slots), `num_pages`
    pages for full layers, `num_sliding_pages` for sliding ones."""

    def __init__(self, shapes: list[tuple[int, int]], layer_is_sliding: list[bool], num_pages: int,
                 num_sliding_pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        self.page_size = page_size
        self.layer_is_sliding = layer_is_sliding
        sizes = [(num_sliding_pages if s else num_pages) * page_size for s in layer_is_sliding]
        self.k = [torch.zeros(n, h, d, dtype=dtype, device=device) for n, (h, d) in zip(sizes, shapes)]
        self.v = [torch.zeros(n, h, d, dtype=dtype, device=device) for n, (h, d) in zip(sizes, shapes)]

    @staticmethod
    def bytes_per_page(shapes: list[tuple[int, int]], layer_is_sliding: list[bool], sliding: bool, page_size: int,
                       dtype: torch.dtype) -> int:
        """Bytes of one page of the full (sliding=False) or the sliding pool, K and V of its layers."""
        per_token = sum(h * d for (h, d), s in zip(shapes, layer_is_sliding) if s == sliding)
        return 2 * page_size * per_token * torch.finfo(dtype).bits // 8

    def save_sliding(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of these sliding slots of every sliding layer (restore_sliding puts them back)."""
        return [(self.k[i][slots].clone(), self.v[i][slots].clone()) if s else None
                for i, s in enumerate(self.layer_is_sliding)] if slots.numel() else []

    def restore_sliding(self, slots: torch.Tensor, saved: list) -> None:
        for i, kv in enumerate(saved):
            if kv is not None:
                self.k[i][slots], self.v[i][slots] = kv


@dataclass
class CanvasRow:
    """One request's part of a forward, in absolute positions (the runner's host view)."""

    key_slots: np.ndarray  # [K] full-pool slots of positions 0..K-1 (cached + this forward's encoder tokens)
    encoder_tokens: np.ndarray  # flat token indices of its encoder tokens (positions K - len .. K-1)
    canvas_tokens: np.ndarray  # flat token indices of its canvas (positions K .. K+L-1), or empty
    sliding_slots: np.ndarray  # [K] sliding-pool slots of positions 0..K-1 (only those in the ring mean anything)
    sliding_writes: np.ndarray  # indices into encoder_tokens whose K/V the sliding ring stores


@dataclass
class CanvasAttentionMetadata:
    full_write_slots: torch.Tensor  # [Te] full-pool slots of every encoder token
    full_write_tokens: torch.Tensor  # [Te] their flat token indices
    write_slots: torch.Tensor  # sliding-pool slots the sliding layers write (a later query sees them)
    write_tokens: torch.Tensor  # their flat token indices
    fresh_keys: torch.Tensor  # [R, K_sliding] flat token index of a sliding prefix key from this forward, -1: cached
    has_fresh: bool  # some fresh_keys >= 0 (a forward with encoder tokens); False: every prefix key is cached
    canvas_gather: torch.Tensor  # [R, L] flat token index of each row's canvas keys (0 where none)
    query_gather: torch.Tensor  # [R, Q] flat token index of each row's queries (0 = padding)
    query_scatter: torch.Tensor  # [T] index of each flat token in the padded [R * Q] queries
    # per layer type (sliding?): padded cache slots of each row's prefix keys [R, K_t] (in that
    # type's pool) and the mask [R, 1, Q, L + K_t] (True = may attend; canvas keys first). Sliding layers gather only
    # the keys some query of the row can see.
    key_slots: dict[bool, torch.Tensor]
    masks: dict[bool, torch.Tensor]  # empty when the Triton kernel runs (it masks from `geometry`)
    # per layer type: [4, R] (prefix keys K, encoder queries, queries, position of prefix key 0): what
    # kernels/canvas_attention.py computes the same masks from
    geometry: dict[bool, torch.Tensor]
    window: int


def build_canvas_metadata(rows: list[CanvasRow], canvas_length: int, window: int, device: torch.device,
                          masks: bool = True) -> CanvasAttentionMetadata:
    """Host arrays are O(keys) (slots, per-row counts); the [R, Q, K] masks are built on the device
    (masks=False: not at all, for the Triton kernel, which derives them from `geometry`)."""
    num_rows = len(rows)
    L = canvas_length
    num_keys = np.array([len(r.key_slots) for r in rows], dtype=np.int64)  # K: prefix keys after the writes
    num_encoder = np.array([len(r.encoder_tokens) for r in rows], dtype=np.int64)
    has_canvas = np.array([len(r.canvas_tokens) > 0 for r in rows])
    num_queries = num_encoder + L * has_canvas
    max_q = int(num_queries.max())
    # each row's first prefix key per layer type: 0, or the oldest position a sliding query sees
    # (encoder query at p: p - window + 1; canvas at K: K - (window - 1))
    oldest_query = np.where(num_encoder > 0, num_keys - num_encoder, num_keys)
    first = {False: np.zeros(num_rows, dtype=np.int64), True: np.maximum(0, oldest_query - (window - 1))}
    key_slots = {}
    for sliding in (False, True):
        max_k = max(int((num_keys - first[sliding]).max()), 1)
        slots = np.zeros((num_rows, max_k), dtype=np.int64)
        for i, (row, lo) in enumerate(zip(rows, first[sliding])):
            slots[i, :len(row.key_slots) - lo] = (row.sliding_slots if sliding else row.key_slots)[lo:]
        key_slots[sliding] = slots
    fresh = np.full(key_slots[True].shape, -1, dtype=np.int64)
    for i, (row, lo) in enumerate(zip(rows, first[True])):
        start = num_keys[i] - num_encoder[i] - lo  # this forward's encoder keys, in the row's sliding keys
        if num_encoder[i]:
            fresh[i, max(start, 0):start + num_encoder[i]] = row.encoder_tokens[max(-start, 0):]
        key_slots[True][i, max(start, 0):start + num_encoder[i]] = 0  # any valid slot: not read
    canvas_gather = np.zeros((num_rows, L), dtype=np.int64)
    query_gather = np.zeros((num_rows, max_q), dtype=np.int64)
    scatter = []
    for i, row in enumerate(rows):
        q = np.concatenate([row.encoder_tokens, row.canvas_tokens])
        if has_canvas[i]:
            canvas_gather[i] = row.canvas_tokens
        query_gather[i, :len(q)] = q
        scatter.append(i * max_q + np.arange(len(q)))
    full_write_slots = np.concatenate([r.key_slots[len(r.key_slots) - len(r.encoder_tokens):] for r in rows])
    full_write_tokens = np.concatenate([r.encoder_tokens for r in rows])
    write_slots = np.concatenate([r.sliding_slots[len(r.key_slots) - len(r.encoder_tokens):][r.sliding_writes]
                                  for r in rows])
    write_tokens = np.concatenate([r.encoder_tokens[r.sliding_writes] for r in rows])

    def dev(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

    per_row = dev(np.stack([num_keys, num_encoder, num_queries, first[True], first[False]]))
    geometry = {True: per_row[:4], False: per_row[[0, 1, 2, 4]]}
    mask = {sliding: _masks(per_row[:4], key_slots[sliding].shape[1], max_q, L, window, sliding)
            for sliding in (False, True)} if masks else {}
    return CanvasAttentionMetadata(dev(full_write_slots), dev(full_write_tokens), dev(write_slots), dev(write_tokens),
                                   dev(fresh), bool((fresh >= 0).any()), dev(canvas_gather), dev(query_gather),
                                   dev(np.concatenate(scatter)), {s: dev(a) for s, a in key_slots.items()}, mask,
                                   geometry, window)


def _masks(per_row: torch.Tensor, max_k: int, max_q: int, canvas_length: int, window: int,
           sliding: bool) -> torch.Tensor:
    """[R, 1, Q, L + max_k] bool from per-row (K, encoder queries, queries, sliding first key)."""
    num_keys, num_encoder, num_queries, sliding_first = (t[:, None, None] for t in per_row)
    device = per_row.device
    first = sliding_first if sliding else torch.zeros_like(sliding_first)
    key_pos = first + torch.arange(max_k, device=device)[None, None, :]  # [R, 1, K]
    query = torch.arange(max_q, device=device)[None, :, None]  # [1, Q, 1]
    q_pos = num_keys - num_encoder + query  # encoder queries sit at positions K - ne .. K - 1
    valid = key_pos < num_keys
    encoder = valid & (key_pos <= q_pos)
    canvas = valid
    if sliding:
        encoder = encoder & (key_pos > q_pos - window)
        canvas = canvas & (key_pos >= num_keys - (window - 1))
    is_encoder = query < num_encoder
    is_canvas = (query >= num_encoder) & (query < num_queries)
    prefix = torch.where(is_encoder, encoder, is_canvas & canvas)
    own_canvas = is_canvas.expand(-1, -1, canvas_length)  # a canvas query sees its whole canvas
    mask = torch.cat([own_canvas, prefix], dim=-1)  # canvas keys first: see PagedCanvasAttention.forward
    padding = (query >= num_queries)[..., 0]  # padded queries see one key so softmax stays finite
    mask[..., 0] |= padding
    return mask[:, None]


class PagedCanvasAttention:
    """The model's `attn.forward(layer_idx, q, k, v)` over a CanvasKVCache: torch sdpa over gathered
    keys, or (kernel=True, attention=triton on CUDA) kernels/canvas_attention.py reading the pools and
    the forward's keys in place, with the same masks."""

    def __init__(self, cache: CanvasKVCache, layer_is_sliding: list[bool], kernel: bool = False):
        self.cache = cache
        self.layer_is_sliding = layer_is_sliding
        self.kernel = kernel
        self.meta: CanvasAttentionMetadata | None = None

    def begin(self, meta: CanvasAttentionMetadata) -> None:
        self.meta = meta

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        cache_k, cache_v = self.cache.k[layer_idx], self.cache.v[layer_idx]
        sliding = self.layer_is_sliding[layer_idx]
        slots = meta.key_slots[sliding]
        if self.kernel:
            return self._kernel_forward(meta, sliding, q, k, v, cache_k, cache_v)
        if sliding:  # read first: this forward's writes may reuse a ring slot it reads
            prefix_k, prefix_v = cache_k[slots], cache_v[slots]
            if meta.has_fresh:
                fresh = (meta.fresh_keys >= 0)[..., None, None]
                index = meta.fresh_keys.clamp(min=0)
                prefix_k = torch.where(fresh, k[index], prefix_k)
                prefix_v = torch.where(fresh, v[index], prefix_v)
            if meta.write_slots.numel():
                cache_k[meta.write_slots] = k[meta.write_tokens]
                cache_v[meta.write_slots] = v[meta.write_tokens]
        else:
            if meta.full_write_slots.numel():
                cache_k[meta.full_write_slots] = k[meta.full_write_tokens]
                cache_v[meta.full_write_slots] = v[meta.full_write_tokens]
            prefix_k, prefix_v = cache_k[slots], cache_v[slots]
        # Canvas keys first, then the prefix, then the padding up to the batch's longest prefix: a
        # row's keys sit at the same offsets whatever else is in the batch, so a kernel that walks
        # the key axis in fixed chunks sums them in the same order (batch invariance); padding keys
        # are masked and add exact zeros at the end.
        keys = torch.cat([k[meta.canvas_gather], prefix_k], dim=1)  # [R, L + K, Hkv, D]
        values = torch.cat([v[meta.canvas_gather], prefix_v], dim=1)
        queries = q[meta.query_gather]  # [R, Q, H, D]
        if q.device.type == "cpu":
            out = _each_row_alone(queries, keys, values, meta.masks[sliding], meta.geometry[sliding])
        else:
            out = F.scaled_dot_product_attention(
                queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=meta.masks[sliding], scale=1.0, enable_gqa=True).transpose(1, 2)
        return out.reshape(-1, q.shape[1], q.shape[2])[meta.query_scatter]

    def _kernel_forward(self, meta: CanvasAttentionMetadata, sliding: bool, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor:
        """The same reads and writes in the same order as `forward`: sliding layers read (this forward's
        own keys straight from k / v) before they write, full layers write first."""
        from fluxlab.kernels.canvas_attention import canvas_attention

        if not sliding and meta.full_write_slots.numel():
            cache_k[meta.full_write_slots] = k[meta.full_write_tokens]
            cache_v[meta.full_write_slots] = v[meta.full_write_tokens]
        out = canvas_attention(q, k, v, cache_k, cache_v, meta.query_gather, meta.canvas_gather,
                               meta.key_slots[sliding], meta.geometry[sliding], meta.window if sliding else 0,
                               fresh=meta.fresh_keys if sliding and meta.has_fresh else None)
        if sliding and meta.write_slots.numel():
            cache_k[meta.write_slots] = k[meta.write_tokens]
            cache_v[meta.write_slots] = v[meta.write_tokens]
        return out


def _each_row_alone(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    geometry: torch.Tensor) -> torch.Tensor:
    """CPU: each row's sdpa over the keys and queries it would have alone ([R, Q, H, D] out, padding rows
    zero). Torch's CPU kernel picks its key blocks by the key axis's length, so a key axis padded to the
    batch's longest prefix rounds a row otherwise than alone: an ulp that FP8 activation quantization can
    turn into another sampled token."""
    out = queries.new_zeros(queries.shape)
    num_keys, _, num_queries, first = geometry.tolist()
    canvas = keys.shape[1] - max(max(k - f for k, f in zip(num_keys, first)), 1)  # keys: canvas, then padded prefix
    for r, (k, q, f) in enumerate(zip(num_keys, num_queries, first)):
        if q == 0:
            continue
        n = canvas + max(k - f, 1)  # as build_canvas_metadata pads a batch of this row alone
        out[r, :q] = F.scaled_dot_product_attention(
            queries[r:r + 1, :q].transpose(1, 2), keys[r:r + 1, :n].transpose(1, 2), values[r:r + 1, :n].transpose(1, 2),
            attn_mask=mask[r:r + 1, :, :q, :n], scale=1.0, enable_gqa=True).transpose(1, 2)[0]
    return out
