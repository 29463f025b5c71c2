"""FlashInfer paged attention with released APIs only (no block-extend mode needed).

Every query block is planned as its own segment over pages 0 .. that block, non-causal: a block
sees its prefix and itself bidirectionally, which is exactly the block-causal rule, so multi-block
rows (prefill chunks, commit + next block) need no custom mask. K/V of every query token is
written to its page before attention (the same contract as the sdpa backend).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from fluxlab.engine.layers.attention import AttentionMetadata, KVCache, PagedBackend
from fluxlab.engine.layers.segments import Segments

WORKSPACE_BYTES = 256 * 2**20
INT_WORKSPACE_BYTES = 8 * 2**20  # FlashInfer's own default for the plan's int buffer


class SharedWorkspace:
    """One float and one int FlashInfer workspace for every wrapper of a runner (eager and every
    captured graph): forwards run one at a time on one stream and each plans right before it runs
    (a graph's plan before each replay), so what one wrapper leaves there is never read by another.

    `last_plan` is the (wrapper, plan arguments) whose plan the int buffer holds now: a wrapper
    asked to plan the same arguments again skips FlashInfer's plan (~1 ms of host time at 64 rows,
    the decode steps of a block repeat their rows), which is exact because the plan reads only
    the arguments and writes only the int buffer and the wrapper's own buffers."""

    def __init__(self, device: torch.device):
        self.float_buffer = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.int_buffer = torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.last_plan: Optional[tuple[object, tuple]] = None


def plan_indices(segments: Segments, block_length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host CSR arrays for FlashInfer (int32): qo_indptr (block_length queries a segment), kv_indptr
    and kv_indices (each segment's pages 0 .. its block, segments in order)."""
    windows = segments.windows
    kv_indptr = np.zeros(windows.shape[0] + 1, dtype=np.int32)
    np.cumsum(windows, out=kv_indptr[1:])
    width = int(windows.max(initial=0))
    # Row-major boolean selection keeps each segment's pages in order, segment after segment.
    inside = np.arange(width) < windows[:, None]
    kv_indices = segments.tables[:, :width][inside].astype(np.int32)
    qo_indptr = np.arange(windows.shape[0] + 1, dtype=np.int32) * block_length
    return qo_indptr, kv_indptr, kv_indices


def plan_tensors(segments: Segments, block_length: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """plan()'s arguments (qo_indptr, kv_indptr on the host, kv_indices on `device`, last page
    lengths), kept with the segments: a batch of the same rows plans from them again."""

    def build():
        qo_indptr, kv_indptr, kv_indices = plan_indices(segments, block_length)
        return (torch.from_numpy(qo_indptr), torch.from_numpy(kv_indptr),
                torch.from_numpy(kv_indices).to(device, non_blocking=True),
                torch.full((segments.num_segments,), block_length, dtype=torch.int32))

    return segments.memo(("flashinfer", block_length, device), build)


class FlashInferAttention(PagedBackend):
    def __init__(self, cache: KVCache, model_config, device: torch.device, *, num_qo_heads: Optional[int] = None,
                 num_kv_heads: Optional[int] = None, graph_segments: int = 0, graph_max_pages: int = 0,
                 workspace: Optional[SharedWorkspace] = None):
        import flashinfer

        self.cache = cache
        self.block_length = cache.block_length
        self.num_qo_heads = num_qo_heads or model_config.num_attention_heads
        self.num_kv_heads = num_kv_heads or model_config.num_key_value_heads
        self.head_dim = model_config.head_dim
        self.device = device
        self.workspace = workspace or SharedWorkspace(device)
        self.graph_segments = graph_segments
        if graph_segments:
            # Fixed buffers: plan() rewrites them in place before each replay of a captured graph.
            self.buffers = dict(
                qo_indptr_buf=torch.zeros(graph_segments + 1, dtype=torch.int32, device=device),
                paged_kv_indptr_buf=torch.zeros(graph_segments + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buf=torch.zeros(graph_max_pages, dtype=torch.int32, device=device),
                paged_kv_last_page_len_buf=torch.zeros(graph_segments, dtype=torch.int32, device=device))
            self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace.float_buffer, "NHD",
                                                                          use_cuda_graph=True, **self.buffers)
        else:
            self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace.float_buffer, "NHD")
        # The constructor allocates a private int buffer; swap in the shared one (public API; the
        # wrapper keeps its own pinned host staging buffer).
        self.wrapper.reset_workspace_buffer(self.workspace.float_buffer, self.workspace.int_buffer)
        self.meta: Optional[AttentionMetadata] = None

    def plan(self, segments: Segments) -> None:
        """Host-side scheduling of the next forward (outside any CUDA graph)."""
        arguments = plan_tensors(segments, self.block_length, self.device)
        last = self.workspace.last_plan
        if last is not None and last[0] is self and last[1] is arguments:
            return
        self.workspace.last_plan = None  # a plan that raises leaves the buffer in no known state
        qo_indptr, kv_indptr, kv_indices, last_page_len = arguments
        self.wrapper.plan(
            qo_indptr, kv_indptr, kv_indices, last_page_len,
            self.num_qo_heads, self.num_kv_heads, self.head_dim, self.block_length,
            causal=False, sm_scale=self.head_dim ** -0.5,
            q_data_type=self.cache.k.dtype, kv_data_type=self.cache.k.dtype,
            # every segment is block_length queries: FlashInfer would find that with a Python max()
            # over a tensor (one 0-d tensor per segment, ~0.2 ms at 64 rows)
            max_token_per_sequence=self.block_length)
        self.workspace.last_plan = (self, arguments)

    def copy_plan_in(self) -> None:
        """Nothing to copy under a graph: the wrapper's plan wrote its buffers before the replay."""

    def begin(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.plan(meta.segments)

    def attend_pages(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        return self.wrapper.run(q.contiguous(), (self.cache.k[layer_idx], self.cache.v[layer_idx]))
