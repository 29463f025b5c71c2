"""The part of an engine every TP rank runs before it has a runner: its device, dtype and seed, and how
many KV pages it gets (scheduler.num_device_pages, else a GPU memory profile, else engine.cpu_kv_cache_gb).
LLMEngine and the TP worker (distributed/worker.py) both inherit it, so every rank profiles with the same
forwards in the same order."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from fluxlab.engine.layers.attention import KVCache
from fluxlab.engine.layers.kv_fp8 import kv_storage_dtype
from fluxlab.engine.loading import DTYPES
from fluxlab.engine.model_runner import ModelRunner
from fluxlab.engine.runner_inputs import StepInputs

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger("fluxlab.engine")


class KVBudget:
    """Needs, before `_num_kv_pages`: `_init_device(cfg)`, then `model`, `model_config`, `block_length`,
    `max_model_len`, `mask_id` and `special` (the model's special ids)."""

    def _init_device(self, cfg: DictConfig) -> None:
        """engine.device / dtype / seed: a bare "cuda" is pinned to the current card."""
        self.cfg = cfg
        self.device = torch.device(cfg.engine.device)
        self.dtype = DTYPES[cfg.engine.dtype]
        torch.manual_seed(cfg.engine.seed)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)

    def _num_kv_pages(self, free_at_start: int) -> int:
        """KV pages: scheduler.num_device_pages, else the GPU profile, else engine.cpu_kv_cache_gb;
        never more than max_num_seqs full-length requests can use. (TP workers run the same rule.)"""
        cfg = self.cfg
        max_pages_useful = cfg.scheduler.max_num_seqs * (self.max_model_len // self.block_length)
        if cfg.scheduler.num_device_pages > 0:
            return cfg.scheduler.num_device_pages
        if self.device.type == "cuda":
            return min(self._profile_num_pages(free_at_start), max_pages_useful)
        return min(int(cfg.engine.cpu_kv_cache_gb * 2**30) // self._page_bytes(), max_pages_useful)

    def _page_bytes(self) -> int:
        c = self.model_config
        kv_heads = getattr(self.model, "num_local_kv_heads", c.num_key_value_heads)
        return KVCache.bytes_per_page(c.num_hidden_layers, self.block_length, kv_heads, c.head_dim,
                                      kv_storage_dtype(self.cfg.model.kv_cache_dtype, self.dtype))

    def _profile_num_pages(self, free_at_start: int) -> int:
        """Pages that fit in (gpu_memory_utilization - safety reserve) of the card after the weights
        and a warm-up forward at the largest batch (max_scheduled_tokens of single-block rows)."""
        eng = self.cfg.engine
        bl = self.block_length
        rows = self.cfg.scheduler.max_scheduled_tokens // bl
        probe = ModelRunner(self.model, rows, bl, self.device, self.dtype, self.cfg.attention.backend,
                            self.max_model_len // bl, self.cfg.scheduler.max_num_seqs, self.mask_id,
                            kv_cache_dtype=self.cfg.model.kv_cache_dtype)
        # The widest forward: every row one block, every seat's block needing logits at each position.
        decoding = min(rows, self.cfg.scheduler.max_num_seqs) * bl
        fake = StepInputs(np.zeros(rows * bl, dtype=np.int64), np.tile(np.arange(bl), rows),
                          [(0, 1, r * bl < decoding, [r]) for r in range(rows)], np.arange(decoding))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        _, logits, _, _ = probe.execute(fake)
        if self.special.delete_id is not None:
            self._probe_levenshtein_step(logits.view(-1, bl, logits.shape[-1]))
        del logits
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - probe.cache.k.nbytes - probe.cache.v.nbytes
        del probe
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free_at_start
        budget = total * (eng.gpu_memory_utilization - eng.gpu_memory_safety_reserve) - used_by_others - peak
        pages = int(budget // self._page_bytes())
        if pages < 1:
            raise RuntimeError(f"no GPU memory left for the KV cache: weights + activations take {peak / 2**30:.1f} GiB "
                               f"of a {eng.gpu_memory_utilization - eng.gpu_memory_safety_reserve:.2f} share; raise "
                               "engine.gpu_memory_utilization or lower scheduler.max_scheduled_tokens")
        log.info("KV profile: peak %.2f GiB with weights, budget %.2f GiB -> %d pages", peak / 2**30,
                 budget / 2**30, pages)
        return pages

    def _probe_levenshtein_step(self, logits: torch.Tensor) -> None:
        """An LLaDA2.2 model may run levenshtein_joint on every seat at once, and its step works on
        fp32 copies of the seats' full logits: run one on the probe's logits so the peak counts it."""
        from fluxlab.engine.decoding.levenshtein_joint import LevenshteinKnobs, LevenshteinState, levenshtein_step

        rows, bl = logits.shape[0], logits.shape[1]
        block = torch.full((rows, bl), self.mask_id, dtype=torch.long, device=self.device)
        prompt = torch.zeros(rows, dtype=torch.long, device=self.device)
        state = LevenshteinState.empty(rows, bl, 2, self.device)
        state.enter_block(torch.arange(rows, device=self.device), block, prompt, self.mask_id)
        ones = torch.ones(rows, dtype=torch.long, device=self.device)
        knobs = LevenshteinKnobs(ones.float() * 0.5, ones.float() * 0.0, ones * bl, ones * 16, ones * 1000)
        levenshtein_step(logits, block, prompt, state, knobs, mask_id=self.mask_id,
                         delete_id=self.special.delete_id, split_id=self.special.split_id)
