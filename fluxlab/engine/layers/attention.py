"""Paged block-causal attention: the interface the model calls, and the sdpa backend.

A forward's rows each hold query tokens for blocks [first_block, first_block + n) of one request.
Every query token's K/V is written to its page first (the active block's page is overwritten by
its commit forward later, so only final tokens' K/V is ever read by a later block); then each
query attends to the request's pages 0 .. its own block: bidirectional inside a block, causal
across blocks. This is the same contract FlashInfer's paged prefill implements (append, then attend).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from fluxlab.engine.layers.segments import Segments


@dataclass
class AttentionMetadata:
    """Per-forward tensors on the engine's device, built once and shared by every layer."""

    slot_mapping: torch.Tensor  # [T] cache slot (page * block_length + offset) of each query token
    segments: Optional[Segments]  # host shape: the query blocks the backend plans (None: planned already)
    # sdpa only (dense padded view of the batch):
    page_indices: Optional[torch.Tensor] = None  # [R, P] pages of each row's window (padded with page 0)
    query_gather: Optional[torch.Tensor] = None  # [R, Q] index into the flat query tokens (padding -> 0)
    query_scatter: Optional[torch.Tensor] = None  # [T] index into the flat [R * Q] padded queries
    mask: Optional[torch.Tensor] = None  # [R, 1, Q, P * block_length] True = may attend


def build_metadata(segments: Segments, block_length: int, device: torch.device,
                   dense: bool = True) -> AttentionMetadata:
    """`dense` adds the padded gather/mask tensors the sdpa backend needs (one padded row per row)."""
    meta = AttentionMetadata(torch.from_numpy(segments.slot_mapping(block_length)).to(device, non_blocking=True),
                             segments)
    if not dense:
        return meta
    bl = block_length
    first, window, tables = segments.row_view()
    num_rows = first.shape[0]
    q_lens = torch.from_numpy(segments.row_segments * bl)
    windows = torch.from_numpy(window)
    max_q, max_pages = int(q_lens.max()), int(windows.max())
    page_idx = torch.from_numpy(np.where(np.arange(max_pages) < window[:, None], tables[:, :max_pages], 0))
    q_offsets = torch.cumsum(q_lens, 0) - q_lens
    q_pos = torch.arange(max_q)[None, :]
    q_valid = q_pos < q_lens[:, None]
    gather = torch.where(q_valid, q_offsets[:, None] + q_pos, 0)
    scatter = (torch.arange(num_rows)[:, None] * max_q + q_pos)[q_valid]
    first_block = torch.from_numpy(first)
    q_block = torch.where(q_valid, first_block[:, None] + q_pos // bl, -1)
    key = torch.arange(max_pages * bl)[None, None, :]
    mask = ((key // bl) <= q_block[:, :, None]) & (key < (windows * bl)[:, None, None])
    mask[:, :, 0] |= ~q_valid  # padded queries see one key so softmax stays finite
    meta.page_indices = page_idx.to(device)
    meta.query_gather = gather.to(device)
    meta.query_scatter = scatter.to(device)
    meta.mask = mask[:, None].to(device)
    return meta


class AttentionBackend(Protocol):
    def begin(self, meta: AttentionMetadata) -> None: ...

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class KVCache:
    """One K and one V pool per layer: [num_pages, block_length, num_kv_heads, head_dim], in the model
    dtype. layers/kv_fp8.py's Fp8KVCache stores them as e4m3 instead; the backends read and write a
    cache only through the methods below (and `k` / `v` with `scales`), so either kind serves them."""

    def __init__(self, num_layers: int, num_pages: int, block_length: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, storage_dtype: Optional[torch.dtype] = None):
        shape = (num_layers, num_pages, block_length, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=storage_dtype or dtype, device=device)
        self.v = torch.zeros(shape, dtype=storage_dtype or dtype, device=device)
        self.block_length = block_length
        self.dtype = dtype  # what writes take and reads give back

    @property
    def quantized(self) -> bool:
        return self.k.dtype != self.dtype

    @staticmethod
    def bytes_per_page(num_layers: int, block_length: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        """Bytes of one page over every layer, K and V, stored as `dtype` (the cache's storage dtype)."""
        return 2 * num_layers * block_length * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def scales(self, layer_idx: int) -> tuple[float, float]:
        """(k_scale, v_scale): a stored value times its scale is the value written. 1 unquantized."""
        return 1.0, 1.0

    def rows(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s K and V pools as [num_pages * block_length, num_kv_heads, head_dim] slot rows."""
        k, v = self.k[layer_idx], self.v[layer_idx]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_rows, v_rows = self.rows(layer_idx)
        k_rows[slot_mapping] = k
        v_rows[slot_mapping] = v

    def gather(self, layer_idx: int, page_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the pages `page_indices` [...] as [..., block_length, num_kv_heads, head_dim] in `dtype`."""
        return self.k[layer_idx][page_indices], self.v[layer_idx][page_indices]

    def write_rows(self, layer_idx: int, slot_mapping: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K rows, V rows, slots) where a kernel that produces K/V itself puts token t's at rows[slots[t]]:
        the pool's slot rows and slot_mapping here; `flush` before the layer's attention reads them."""
        return (*self.rows(layer_idx), slot_mapping)

    def flush(self, layer_idx: int, slot_mapping: torch.Tensor) -> None:
        """Whatever `write_rows` handed out is in the pages after this (here it went there directly)."""


class PagedBackend(ABC):
    """A backend whose forward writes the forward's K/V to their cache slots, then attends from the
    pages. A model whose own kernel produces K/V (the fused QK-norm + RoPE) writes them to `kv_rows`
    itself and calls `attend`: the separate write was two index_put launches a layer (~0.3 ms of a
    batch-64 decode forward on the H200, docs/benchmarks.md §21)."""

    cache: KVCache
    meta: Optional[AttentionMetadata]

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer_idx, self.meta.slot_mapping, k, v)
        return self.attend_pages(layer_idx, q)

    def kv_rows(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K rows, V rows, slots [T]): where the model's kernel puts token t's K/V (the cache's slot
        rows; for an FP8 cache rows in the model dtype that `attend` quantizes into the pages)."""
        return self.cache.write_rows(layer_idx, self.meta.slot_mapping)

    def attend(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of q after the model wrote this forward's K/V to `kv_rows`."""
        self.cache.flush(layer_idx, self.meta.slot_mapping)
        return self.attend_pages(layer_idx, q)

    @abstractmethod
    def attend_pages(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of q [T, Hq, D] over the pages, this forward's K/V already in their slots."""


class SdpaAttention(PagedBackend):
    """Gathers each row's pages into a padded batch and calls torch sdpa with the block-causal mask."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.meta: Optional[AttentionMetadata] = None

    def begin(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    def attend_pages(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        heads, dim = q.shape[1], q.shape[2]
        keys, values = (t.flatten(1, 2) for t in self.cache.gather(layer_idx, meta.page_indices))  # [R, P*bl, Hkv, D]
        queries = q[meta.query_gather]  # [R, Q, Hq, D]
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=meta.mask, scale=dim ** -0.5, enable_gqa=True)
        return out.transpose(1, 2).reshape(-1, heads, dim)[meta.query_scatter]
