"""Paged block-causal attention through fluxlab's own Triton kernel (kernels/block_attention.py):
FA4's plan (a page table and key counts on the device, layers/page_tables.py) with no host-side
scheduling at all: a batch of new rows costs two small host tables instead of FlashInfer's plan."""
from __future__ import annotations

import torch

from fluxlab.engine.layers.page_tables import PageTableAttention
from fluxlab.kernels.block_attention import block_attention


class TritonAttention(PageTableAttention):
    def attend_pages(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        k_scale, v_scale = self.cache.scales(layer_idx)  # FP8 pages are dequantized in the kernel
        return block_attention(q, self.cache.k[layer_idx], self.cache.v[layer_idx], self.page_table,
                               self.seqused_k, self.head_dim ** -0.5, k_scale=k_scale, v_scale=v_scale)
