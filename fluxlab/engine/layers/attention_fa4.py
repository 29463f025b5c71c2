"""FlashAttention 4 (flash-attn-4, CuTe DSL) paged attention, the same segment plan as FlashInfer.

Every query block is one segment of exactly block_length queries over the request's pages 0 .. that
block, non-causal (bidirectional inside the block, causal across blocks: the block-causal rule), so
a decode row is one segment, a commit + decode row two and a prefill chunk of n blocks n. A batch of
S segments is one FA4 call on q viewed as [S, block_length, Hq, D] with a page table [S, P] and
seqused_k [S] = (block + 1) * block_length; K/V are written to their pages first (the sdpa contract).

FA4's eager call costs ~0.2 ms of host time (measured on H200, DESIGN §8), twenty times per forward,
so it belongs under CUDA graphs: with `graph_segments` the page table and lengths are fixed device
buffers that `plan` rewrites in place before each replay.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from fluxlab.engine.layers.attention import AttentionMetadata, KVCache
from fluxlab.engine.layers.segments import Segments


def segment_tables(segments: Segments, width: int, fill_page: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Host (page_table [S, width] int32, pages_used [S] int32): one segment per query block, over
    pages 0..block. Entries past a segment's pages hold `fill_page`: FA4 may load whole key tiles
    past seqused_k (masked, but a NaN row would still poison P @ V), so they must be a real page."""
    windows = segments.windows
    if windows.shape[0] and int(windows.max()) > width:
        raise ValueError(f"a segment attends to {int(windows.max())} pages, past the table width {width}")
    held = min(width, segments.tables.shape[1])
    table = np.full((windows.shape[0], width), fill_page, dtype=np.int32)
    table[:, :held] = np.where(np.arange(held) < windows[:, None], segments.tables[:, :held], fill_page)
    return table, windows.astype(np.int32)


class Fa4Attention:
    def __init__(self, cache: KVCache, device: torch.device, *, num_qo_heads: int, head_dim: int,
                 max_blocks_per_seq: int, graph_segments: int = 0):
        from flash_attn.cute import flash_attn_varlen_func

        self.attend = flash_attn_varlen_func
        self.cache = cache
        self.block_length = cache.block_length
        self.num_qo_heads = num_qo_heads
        self.head_dim = head_dim
        self.device = device
        self.max_pages = max_blocks_per_seq
        self.graph_segments = graph_segments
        self.page_table: Optional[torch.Tensor] = None
        self.seqused_k: Optional[torch.Tensor] = None
        if graph_segments:
            self.page_table = torch.zeros(graph_segments, max_blocks_per_seq, dtype=torch.int32, device=device)
            self.seqused_k = torch.full((graph_segments,), self.block_length, dtype=torch.int32, device=device)
        self.planned: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # what the graph buffers hold
        self.meta: Optional[AttentionMetadata] = None

    def plan(self, segments: Segments) -> None:
        """Host-side tables of the next forward (outside any CUDA graph)."""
        width = self.max_pages if self.graph_segments else int(segments.windows.max())
        # (host tables, kept with the segments: a batch of the same rows plans from them again)
        planned = segments.memo(("fa4", width, self.block_length), lambda: self._plan_tensors(segments, width))
        table, tokens = planned
        if self.graph_segments:
            assert table.shape[0] == self.graph_segments, (table.shape, self.graph_segments)
            if self.planned is planned:  # only this graph writes its buffers: they hold these tables
                return
            self.planned = None  # a copy that raises leaves the buffers in no known state
            self.page_table.copy_(table, non_blocking=True)
            self.seqused_k.copy_(tokens, non_blocking=True)
            self.planned = planned
        else:
            self.page_table = table.to(self.device, non_blocking=True)
            self.seqused_k = tokens.to(self.device, non_blocking=True)

    def _plan_tensors(self, segments: Segments, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        table, used = segment_tables(segments, width)
        return torch.from_numpy(table), torch.from_numpy(used * self.block_length)

    def begin(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.plan(meta.segments)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer_idx, self.meta.slot_mapping, k, v)
        bl = self.block_length
        segments = q.shape[0] // bl
        out = self.attend(q.view(segments, bl, self.num_qo_heads, self.head_dim),
                          self.cache.k[layer_idx], self.cache.v[layer_idx],
                          page_table=self.page_table, seqused_k=self.seqused_k,
                          softmax_scale=self.head_dim ** -0.5, causal=False)
        if isinstance(out, tuple):  # (out, lse) in some releases
            out = out[0]
        return out.view(-1, self.num_qo_heads, self.head_dim)
