"""The only owner of device tensors: weights, KV pages, the forward and the logits of active blocks."""
from __future__ import annotations

import logging
from typing import Optional

import torch

from fluxlab.engine.layers.attention import KVCache, SdpaAttention, build_metadata
from fluxlab.engine.scheduler import ScheduledBatch

log = logging.getLogger("fluxlab.engine")


class ModelRunner:
    def __init__(self, model, num_pages: int, block_length: int, device: torch.device, dtype: torch.dtype,
                 backend: str = "sdpa"):
        cfg = model.config
        self.model = model
        self.block_length = block_length
        self.device = device
        kv_heads = getattr(model, "num_local_kv_heads", cfg.num_key_value_heads)  # per TP rank
        self.cache = KVCache(cfg.num_hidden_layers, num_pages, block_length, kv_heads,
                             cfg.head_dim, dtype, device)
        self.attention = self._make_backend(backend)

    def _make_backend(self, backend: str):
        if backend == "sdpa":
            return SdpaAttention(self.cache)
        if backend == "flashinfer":
            from fluxlab.engine.layers.attention_flashinfer import FlashInferAttention

            return FlashInferAttention(self.cache, self.model.config, self.device)
        raise ValueError(f"attention.backend={backend} is not available in this build; use sdpa or flashinfer")

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, mask_id: Optional[int] = None) -> Optional[torch.Tensor]:
        """One forward over every row; logits [rows that decode, block_length, vocab] in fp32."""
        bl = self.block_length
        input_ids, positions, logit_index = [], [], []
        offset = 0
        for row in batch.rows:
            request = row.request
            start = row.first_block * bl
            end = start + row.num_blocks * bl
            input_ids.extend(request.tokens[start:end])
            positions.append(torch.arange(start, end))
            if row.decodes:
                logit_index.append(torch.arange(offset + end - start - bl, offset + end - start))
            offset += end - start
        meta = build_metadata([(r.first_block, r.num_blocks, r.request.page_table) for r in batch.rows], bl,
                              self.device)
        self.attention.begin(meta)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.cat(positions).to(self.device)
        hidden = self.model(ids, pos, self.attention)
        if not logit_index:
            return None
        rows = torch.cat(logit_index).to(self.device)
        logits = self.model.compute_logits(hidden[rows])
        return logits.view(-1, bl, logits.shape[-1])
