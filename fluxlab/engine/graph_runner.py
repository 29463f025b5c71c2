"""CUDA graphs of the model body keyed by padded segment count: one graph runner for every batch.

A forward is a list of query segments of exactly block_length tokens each (a row of n blocks is n
segments: the attention backend, FlashInfer or FA4, plans each block over pages 0..itself), so a
graph captured for S segments replays any batch of at most S segments whatever its mix: decode rows
(1 segment), commit + decode rows (2), prefill chunks (n), any row count. Padding segments read and write a scratch page. The
graph ends at the last hidden state; the logits head runs after it on only the positions the
decoders need, whose count changes every step.
"""
from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

import numpy as np
import torch

from fluxlab.engine.layers.attention import AttentionMetadata
from fluxlab.engine.layers.segments import Segments

log = logging.getLogger("fluxlab.engine")


def plan_chunks(row_segments: Sequence[int], sizes: list[int], mode: str) -> Optional[list[tuple[int, int]]]:
    """(number of rows, captured size) chunks that cover the rows in order, or None (run eagerly).
    padded: one chunk, the smallest size that holds the batch; decomposed: chunks of the largest
    size the remaining segments fill (rows are never split), the last one padded."""
    if mode == "padded":
        total = int(np.sum(row_segments))
        if total > sizes[-1]:
            return None
        return [(len(row_segments), next(s for s in sizes if s >= total))]
    row_segments = [int(n) for n in row_segments]
    chunks, start = [], 0
    while start < len(row_segments):
        remaining = sum(row_segments[start:])
        cap = max([s for s in sizes if s <= remaining], default=sizes[0])
        if row_segments[start] > cap:
            cap = next((s for s in sizes if s >= row_segments[start]), None)
            if cap is None:
                return None  # one row longer than the largest graph
        taken, used = 0, 0
        while start + taken < len(row_segments) and used + row_segments[start + taken] <= cap:
            used += row_segments[start + taken]
            taken += 1
        chunks.append((taken, next(s for s in sizes if s >= used)))
        start += taken
    return chunks


class CapturedForward:
    def __init__(self, runner, segments: int, pool):
        bl, device = runner.block_length, runner.device
        tokens = segments * bl
        self.segments = segments
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.positions = torch.arange(tokens, device=device) % bl
        self.scratch_slots = runner.scratch_slots.repeat(segments)
        self.slots = self.scratch_slots.clone()
        self.attention = runner._make_backend(runner.backend, graph_segments=segments)
        self.attention.meta = AttentionMetadata(self.slots, None)  # planned before each replay
        self.scratch_page = runner.scratch_page
        self.attention.plan(Segments.scratch(segments, self.scratch_page))
        model = runner.model
        for _ in range(2):  # warm up outside the graph (allocator, lazy inits, Triton JIT)
            model(self.input_ids, self.positions, self.attention)
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.hidden = model(self.input_ids, self.positions, self.attention)

    def load(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, segments: Segments) -> None:
        """Inputs in place and the attention plan of the next replay."""
        n = ids.shape[0]
        self.input_ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(slots)
        if n < self.slots.shape[0]:
            self.slots[n:].copy_(self.scratch_slots[n:])  # padding writes K/V only to the scratch page
        self.attention.plan(segments.padded(self.segments - segments.num_segments, self.scratch_page))

    def replay(self, num_tokens: int) -> torch.Tensor:
        self.graph.replay()
        return self.hidden[:num_tokens]


class GraphRunner:
    """Captured forwards by segment count; `can_run` says whether a batch replays or runs eagerly."""

    def __init__(self, runner, segment_sizes: list[int], mode: str = "padded"):
        self.runner = runner
        self.mode = mode
        self.sizes = sorted(set(segment_sizes))
        self.graphs: dict[int, CapturedForward] = {}
        self.num_replays = 0
        self.num_eager = 0
        started = time.perf_counter()
        free_before, _ = torch.cuda.mem_get_info(runner.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: the pool's blocks fit the smaller ones
            self.graphs[size] = CapturedForward(runner, size, pool)
        torch.cuda.synchronize(runner.device)
        free_after, _ = torch.cuda.mem_get_info(runner.device)
        log.info("captured %d forward graphs for %s segments (%s) in %.1f s using %.2f GiB", len(self.graphs),
                 self.sizes, mode, time.perf_counter() - started, (free_before - free_after) / 2**30)

    def can_run(self, segments: Segments) -> bool:
        return plan_chunks(segments.row_segments, self.sizes, self.mode) is not None

    def run(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, segments: Segments
            ) -> torch.Tensor:
        """hidden [T, H] of the batch (every row must be `can_run`)."""
        bl = self.runner.block_length
        chunks = plan_chunks(segments.row_segments, self.sizes, self.mode)
        self.num_replays += 1
        parts, row, tok = [], 0, 0
        for taken, size in chunks:
            chunk = segments if len(chunks) == 1 else segments.rows_range(row, row + taken)
            n = chunk.num_segments * bl
            graph = self.graphs[size]
            graph.load(ids[tok:tok + n], positions[tok:tok + n], slots[tok:tok + n], chunk)
            if not parts:  # the GPU waits for the first plan; later chunks plan while it runs
                self.runner.launched_at = time.perf_counter()
            hidden = graph.replay(n)
            if len(chunks) == 1:
                return hidden
            parts.append(hidden.clone())  # graphs share one pool: copy out before the next replay
            row, tok = row + taken, tok + n
        return torch.cat(parts)

    def release(self) -> None:
        torch.cuda.synchronize(self.runner.device)
        self.graphs.clear()
