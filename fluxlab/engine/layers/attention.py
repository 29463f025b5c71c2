"""Paged block-causal attention: the interface the model calls, and the sdpa backend.

A forward's rows each hold query tokens for blocks [first_block, first_block + n) of one request.
Every query token's K/V is written to its page first (the active block's page is overwritten by
its commit forward later, so only final tokens' K/V is ever read by a later block); then each
query attends to the request's pages 0 .. its own block: bidirectional inside a block, causal
across blocks. This is the same contract FlashInfer's paged prefill implements (append, then attend).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-forward tensors on the engine's device, built once and shared by every layer."""

    slot_mapping: torch.Tensor  # [T] cache slot (page * block_length + offset) of each query token
    page_indices: torch.Tensor  # [R, P] pages of each row's window (padded with page 0)
    kv_lens: torch.Tensor  # [R] tokens in each row's window
    query_gather: torch.Tensor  # [R, Q] index into the flat query tokens (padding -> 0)
    query_scatter: torch.Tensor  # [T] index into the flat [R * Q] padded queries
    mask: torch.Tensor  # [R, 1, Q, P * block_length] True = may attend
    # Host-side shape of the forward, for backends that plan per step (FlashInfer) and CUDA graphs.
    qo_lens: list[int]
    first_blocks: list[int]
    page_tables: list[list[int]]


def build_metadata(rows: list[tuple[int, int, list[int]]], block_length: int, device: torch.device) -> AttentionMetadata:
    """rows: (first_block, num_blocks, page_table) per row, in batch order."""
    bl = block_length
    num_rows = len(rows)
    max_q = max(n for _, n, _ in rows) * bl
    max_pages = max(first + n for first, n, _ in rows)
    slots, gather, scatter = [], [], []
    page_idx = torch.zeros(num_rows, max_pages, dtype=torch.long)
    kv_lens, qo_lens = [], []
    q_block = torch.full((num_rows, max_q), -1, dtype=torch.long)
    offset = 0
    for r, (first, n, pages) in enumerate(rows):
        window = first + n
        page_idx[r, :window] = torch.tensor(pages[:window])
        kv_lens.append(window * bl)
        qo_lens.append(n * bl)
        for j in range(n):
            page = pages[first + j]
            slots.append(torch.arange(page * bl, (page + 1) * bl))
            q_block[r, j * bl:(j + 1) * bl] = first + j
        gather.append(torch.cat([torch.arange(offset, offset + n * bl),
                                 torch.zeros(max_q - n * bl, dtype=torch.long)]))
        scatter.append(torch.arange(r * max_q, r * max_q + n * bl))
        offset += n * bl
    key_block = (torch.arange(max_pages * bl) // bl)[None, None, :]
    kv_len_t = torch.tensor(kv_lens)
    key_valid = torch.arange(max_pages * bl)[None, None, :] < kv_len_t[:, None, None]
    mask = (key_block <= q_block[:, :, None]) & key_valid
    mask[:, :, 0] |= q_block < 0  # padded queries see one key so softmax stays finite
    return AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        page_indices=page_idx.to(device),
        kv_lens=kv_len_t.to(device),
        query_gather=torch.stack(gather).to(device),
        query_scatter=torch.cat(scatter).to(device),
        mask=mask[:, None].to(device),
        qo_lens=qo_lens,
        first_blocks=[first for first, _, _ in rows],
        page_tables=[list(pages[: first + n]) for first, n, pages in rows],
    )


class AttentionBackend(Protocol):
    def begin(self, meta: AttentionMetadata) -> None: ...

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class KVCache:
    """One K and one V pool per layer: [num_pages, block_length, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_pages: int, block_length: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_pages, block_length, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_length = block_length

    @staticmethod
    def bytes_per_page(num_layers: int, block_length: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        return 2 * num_layers * block_length * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer_idx].view(-1, *k.shape[1:])[slot_mapping] = k
        self.v[layer_idx].view(-1, *v.shape[1:])[slot_mapping] = v


class SdpaAttention:
    """Gathers each row's pages into a padded batch and calls torch sdpa with the block-causal mask."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.meta: Optional[AttentionMetadata] = None

    def begin(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        self.cache.write(layer_idx, meta.slot_mapping, k, v)
        num_rows, max_pages = meta.page_indices.shape
        heads, dim = q.shape[1], q.shape[2]
        keys = self.cache.k[layer_idx][meta.page_indices].flatten(1, 2)  # [R, P*bl, Hkv, D]
        values = self.cache.v[layer_idx][meta.page_indices].flatten(1, 2)
        queries = q[meta.query_gather]  # [R, Q, Hq, D]
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=meta.mask, scale=dim ** -0.5, enable_gqa=True)
        return out.transpose(1, 2).reshape(-1, heads, dim)[meta.query_scatter]
