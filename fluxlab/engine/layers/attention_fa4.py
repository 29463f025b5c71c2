"""FlashAttention 4 (flash-attn-4, CuTe DSL) paged attention, the same segment plan as FlashInfer.

Every query block is one segment of exactly block_length queries over the request's pages 0 .. that
block, non-causal (bidirectional inside the block, causal across blocks: the block-causal rule), so
a decode row is one segment, a commit + decode row two and a prefill chunk of n blocks n. A batch of
S segments is one FA4 call on q viewed as [S, block_length, Hq, D] with a page table [S, P] and
seqused_k [S] = (block + 1) * block_length; K/V are written to their pages first (the sdpa contract).

FA4's eager call costs ~0.2 ms of host time (measured on H200, DESIGN §8), twenty times per forward,
so it belongs under CUDA graphs: with `graph_segments` the page table and lengths are fixed device
buffers the graph fills from the host tables `plan` wrote (layers/page_tables.py).
"""
from __future__ import annotations

import torch

from fluxlab.engine.layers.page_tables import PageTableAttention


class Fa4Attention(PageTableAttention):
    def __init__(self, *args, **kwargs):
        from flash_attn.cute import flash_attn_varlen_func

        super().__init__(*args, **kwargs)
        self.kernel = flash_attn_varlen_func

    def attend_pages(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        bl = self.block_length
        segments = q.shape[0] // bl
        out = self.kernel(q.view(segments, bl, self.num_qo_heads, self.head_dim),
                          self.cache.k[layer_idx], self.cache.v[layer_idx],
                          page_table=self.page_table, seqused_k=self.seqused_k,
                          softmax_scale=self.head_dim ** -0.5, causal=False)
        if isinstance(out, tuple):  # (out, lse) in some releases
            out = out[0]
        return out.view(-1, self.num_qo_heads, self.head_dim)
