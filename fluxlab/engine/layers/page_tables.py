"""Backends that read each query block's page table on the device (FA4, the Triton kernel): the
host's whole plan is two small tables. Under CUDA graphs the host writes them into pinned memory
mapped into the GPU's address space, and the graph's first kernels copy them into its fixed buffers
(engine/staging.py: a copy call before the replay would cost the host more than the plan itself).

Every query block is one segment of exactly block_length queries over its request's pages 0 .. that
block (layers/segments.py), so a segment's table row and its key count (block + 1) * block_length
are all such a kernel needs; the same rows again (a block's decode steps) skip even the copies.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from fluxlab.engine.layers.attention import AttentionMetadata, KVCache, PagedBackend
from fluxlab.engine.layers.segments import Segments
from fluxlab.engine.staging import mapped_host


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


class PageTableAttention(PagedBackend):
    """The plan half: `page_table` [S, W] int32 and `seqused_k` [S] int32 (keys each segment attends
    to) on the device; with `graph_segments` they are fixed buffers that `copy_plan_in` (captured at
    the head of the graph) fills from the mapped host tables `plan` wrote. Subclasses `attend`."""

    def __init__(self, cache: KVCache, device: torch.device, *, num_qo_heads: int, head_dim: int,
                 max_blocks_per_seq: int, graph_segments: int = 0):
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
            # One int32 region, table then key counts, so one kernel copies the plan in.
            size = graph_segments * (max_blocks_per_seq + 1)
            self._host_plan, self._mapped_plan = mapped_host(size, device, torch.int32)
            self._plan = torch.zeros(size, dtype=torch.int32, device=device)
            self._host_table = self._host_plan[:-graph_segments].reshape(graph_segments, max_blocks_per_seq)
            self._host_used = self._host_plan[-graph_segments:]
            self.page_table = self._plan[:-graph_segments].view(graph_segments, max_blocks_per_seq)
            self.seqused_k = self._plan[-graph_segments:]
        self.planned: Optional[Segments] = None  # the segments whose tables the graph's host plan holds
        self.meta: Optional[AttentionMetadata] = None

    def plan(self, segments: Segments) -> None:
        """Host-side tables of the next forward (outside any CUDA graph)."""
        if self.graph_segments and self.planned is segments:  # only this graph writes its tables
            return
        width = self.max_pages if self.graph_segments else int(segments.windows.max())
        # (host tables, kept with the segments: a batch of the same rows plans from them again)
        table, used = segments.memo(("page_tables", width), lambda: segment_tables(segments, width))
        if self.graph_segments:
            assert table.shape[0] == self.graph_segments, (table.shape, self.graph_segments)
            self.planned = None  # a write that raises leaves the tables in no known state
            self._host_table[:] = table
            np.multiply(used, self.block_length, out=self._host_used)
            self.planned = segments
        else:
            self.page_table = torch.from_numpy(table).to(self.device, non_blocking=True)
            self.seqused_k = torch.from_numpy(used * self.block_length).to(self.device, non_blocking=True)

    def copy_plan_in(self) -> None:
        """Under a graph: the planned tables into the buffers the kernels read (a kernel, not a
        memcpy node: the source is host memory the GPU reads at its host address)."""
        torch.add(self._mapped_plan, 0, out=self._plan)

    def begin(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.plan(meta.segments)
