"""CUDA graphs of the model body keyed by padded segment count: one graph runner for every batch.

A forward is a list of query segments of exactly block_length tokens each (a row of n blocks is n
segments: the attention backend plans each block over pages 0..itself), so a graph captured for S
segments replays any batch of at most S segments whatever its mix: decode rows (1 segment), commit +
decode rows (2), prefill chunks (n), any row count. Padding segments read and write a scratch page.
A graph starts by reading its inputs (and a page-table backend's plan) from host memory the runner
wrote (staging.py) and ends at the last hidden state; the logits head runs after it on only the
positions the decoders need, whose count changes every step.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch

from fluxlab.engine.layers.attention import AttentionMetadata
from fluxlab.engine.layers.segments import Segments
from fluxlab.engine.staging import mapped_host
from fluxlab.kernels import pdl
from fluxlab.kernels.tma import graph_tiles

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger("fluxlab.engine")


def ladder_sizes(top: int) -> set[int]:
    """Graph sizes 1..top with a step that grows with the size (1 to 32, then 2, 4 from 64, 8 from
    128, ...): a padded forward never runs more than 1/16 more segments than it needs."""
    sizes, n = set(), 1
    while n <= top:
        sizes.add(n)
        n += 1 << (n // 32).bit_length()
    return sizes


def graph_segment_sizes(cfg: DictConfig) -> list[int]:
    """Segment counts (blocks per forward) to capture: each decode batch size and twice it (every
    row committing and decoding), and `ladder_sizes` up to the largest of those (FDFO batches mix
    1- and 2-block rows: 16 decode rows and 2 commits are 18 segments, which a ladder of 8s pads to
    24, one of 4s to 20; bench/graph_padding), plus cuda_graph_capture_sizes / block_length with
    prefill graphs; never more than a forward can hold (scheduler.max_scheduled_tokens). The graphs
    share one attention workspace, so a denser ladder costs capture time (~0.1 s a graph on an H200)
    and little memory."""
    attn, bl = cfg.attention, cfg.decoding.block_length
    limit = cfg.scheduler.max_scheduled_tokens // bl
    sizes = set()
    if attn.use_decode_cuda_graph:
        sizes |= {n for b in attn.cuda_graph_capture_bs for n in (b, 2 * b)}
        sizes |= ladder_sizes(max(sizes))
    if attn.use_prefill_cuda_graph:
        sizes |= {t // bl for t in attn.cuda_graph_capture_sizes}
    return sorted(n for n in sizes if 1 <= n <= limit)


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
        # ids, positions, slots: the host writes them into mapped pinned memory (staging.py), the
        # graph's first kernel copies them in; padding tokens sit at block offsets of the scratch page
        staged, self.staged_on_device = mapped_host(3 * tokens, device)
        self.staged = staged.reshape(3, tokens)
        self.staged[1] = np.arange(tokens) % bl
        self.staged[2] = runner.scratch_slots.repeat(segments).cpu().numpy()
        self.padding = self.staged.copy()
        self.loaded: Optional[Segments] = None  # the segments whose positions and slots are staged
        self.inputs = torch.from_numpy(self.staged).to(device)
        self.input_ids, self.positions, self.slots = self.inputs.unbind(0)
        self.attention = runner._make_backend(runner.backend, graph_segments=segments)
        self.attention.meta = AttentionMetadata(self.slots, None)  # planned before each replay
        self.scratch_page = runner.scratch_page
        self.attention.plan(Segments.scratch(segments, self.scratch_page))
        model = runner.model
        # GEMMs take TMA tiles (kernels/tma.py), compiled in the warm-up; PDL by size (kernels/pdl.py)
        with graph_tiles(), pdl.forward_of(tokens):
            for _ in range(2):  # warm up outside the graph (allocator, lazy inits, Triton JIT)
                self.attention.copy_plan_in()
                model(self.input_ids, self.positions, self.attention)
            torch.cuda.synchronize(device)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                # a kernel, not a memcpy node: the source is host memory the GPU reads at its host address
                torch.add(self.staged_on_device.view(3, tokens), 0, out=self.inputs)
                self.attention.copy_plan_in()  # the attention plan, where the backend stages it the same way
                self.hidden = model(self.input_ids, self.positions, self.attention)

    def load(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, segments: Segments) -> None:
        """The next replay's inputs, written where the graph reads them (positions and slots only
        when the rows are not the last load's), and its attention plan."""
        n = ids.shape[0]
        padded = segments.padded(self.segments - segments.num_segments, self.scratch_page)
        staged = self.staged
        staged[0, :n] = ids
        staged[0, n:] = 0
        if self.loaded is not padded:
            self.loaded = None  # half-written rows must not pass for these segments
            staged[1, :n], staged[2, :n] = positions, slots
            staged[1:, n:] = self.padding[1:, n:]
            self.loaded = padded
        self.attention.plan(padded)

    def replay(self, num_tokens: int) -> torch.Tensor:
        self.graph.replay()
        return self.hidden[:num_tokens]


class GraphRunner:
    """Captured forwards by segment count; `can_run` says whether a batch replays or runs eagerly."""

    def __init__(self, runner, segment_sizes: list[int], mode: str = "padded"):
        self.runner = runner
        self.mode = mode
        self.sizes = sorted(set(segment_sizes))
        self._chunks_key = ("graph_chunks", mode, tuple(self.sizes))
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

    def chunks(self, segments: Segments) -> Optional[list[tuple[int, int]]]:
        """plan_chunks of these segments (kept with them: the same rows plan once)."""
        return segments.memo(self._chunks_key, lambda: plan_chunks(segments.row_segments, self.sizes, self.mode))

    def can_run(self, segments: Segments) -> bool:
        return self.chunks(segments) is not None

    def run(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, segments: Segments
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [T, H], the input ids on the device) of the batch (every row must be `can_run`)."""
        bl = self.runner.block_length
        chunks = self.chunks(segments)
        self.num_replays += 1
        parts, part_ids, replayed, row, tok = [], [], set(), 0, 0
        for taken, size in chunks:
            chunk = segments if len(chunks) == 1 else segments.rows_range(row, row + taken)
            n = chunk.num_segments * bl
            graph = self.graphs[size]
            if size in replayed:  # a size serving two chunks: its replay must have read what it staged
                self.runner.staging.wait_read()
            graph.load(ids[tok:tok + n], positions[tok:tok + n], slots[tok:tok + n], chunk)
            if not parts:  # the GPU waits for the first plan; later chunks plan while it runs
                self.runner.launched_at = time.perf_counter()
            hidden = graph.replay(n)
            self.runner.staging.queued_read()
            replayed.add(size)
            if len(chunks) == 1:
                return hidden, graph.input_ids[:n]
            # graphs share one pool: copy out before the next replay
            parts.append(hidden.clone())
            part_ids.append(graph.input_ids[:n].clone())
            row, tok = row + taken, tok + n
        return torch.cat(parts), torch.cat(part_ids)

    def release(self) -> None:
        torch.cuda.synchronize(self.runner.device)
        self.graphs.clear()
