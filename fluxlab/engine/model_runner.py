"""The only owner of device tensors: weights, KV pages, CUDA graphs, the forward and the logits.

Decode steps where every row runs exactly its active block (or the commit of its finished block
fused with its next block's first step) replay a CUDA graph captured for a fixed batch of B rows
when decode graphs are on; prefill and mixed steps run eagerly."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from fluxlab.engine.layers.attention import AttentionMetadata, KVCache, SdpaAttention, build_metadata
from fluxlab.engine.scheduler import ScheduledBatch

log = logging.getLogger("fluxlab.engine")

Rows = list[tuple[int, int, list[int]]]


@dataclass
class StepInputs:
    """One forward's inputs as plain host data: the flattened tokens and their positions, and per
    row (first_block, num_blocks, decodes, page_table). Rank 0 broadcasts it to TP workers."""

    token_ids: list[int]
    positions: list[int]
    rows: list[tuple[int, int, bool, list[int]]]


class DecodeGraph:
    """One captured forward of `batch_size` rows of `blocks` blocks each, logits of each row's last
    block: blocks=1 is a plain decode step, blocks=2 a commit fused with the next block's first step
    (under the paged policy every row crosses a block boundary on the same step)."""

    def __init__(self, runner: "ModelRunner", batch_size: int, blocks: int, pool):
        from fluxlab.engine.layers.attention_flashinfer import FlashInferAttention

        bl, device = runner.block_length, runner.device
        tokens = batch_size * blocks * bl
        self.batch_size, self.blocks = batch_size, blocks
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.positions = torch.arange(tokens, device=device) % (blocks * bl)
        self.slots = runner.scratch_slots.repeat(batch_size * blocks)
        self.attention = FlashInferAttention(runner.cache, runner.model.config, device,
                                             num_qo_heads=runner.num_qo_heads, num_kv_heads=runner.num_kv_heads,
                                             graph_segments=batch_size * blocks,
                                             graph_max_pages=batch_size * blocks * runner.max_blocks_per_seq)
        self.attention.meta = AttentionMetadata(self.slots, [])
        self.scratch_rows: Rows = [(0, blocks, [runner.scratch_page] * blocks)] * batch_size
        self.attention.plan(self.scratch_rows)
        last_block = torch.arange(batch_size, device=device)[:, None] * blocks * bl + (blocks - 1) * bl
        self.logit_rows = (last_block + torch.arange(bl, device=device)).flatten()
        model = runner.model
        for _ in range(2):  # warm up outside the graph (allocator, lazy inits, Triton JIT)
            model.compute_logits(model(self.input_ids, self.positions, self.attention)[self.logit_rows])
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            hidden = model(self.input_ids, self.positions, self.attention)
            self.logits = model.compute_logits(hidden[self.logit_rows])

    def replay(self, runner: "ModelRunner", ids: torch.Tensor, positions: torch.Tensor, rows: Rows) -> torch.Tensor:
        n = len(rows) * self.blocks * runner.block_length
        pad = self.batch_size - len(rows)
        self.input_ids[:n].copy_(ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:n].copy_(build_metadata(rows, runner.block_length, runner.device, dense=False).slot_mapping)
        if pad:
            self.slots[n:].copy_(runner.scratch_slots.repeat(pad * self.blocks))
        self.attention.plan(rows + self.scratch_rows[:pad])
        self.graph.replay()
        return self.logits[: len(rows) * runner.block_length]


class ModelRunner:
    def __init__(self, model, num_pages: int, block_length: int, device: torch.device, dtype: torch.dtype,
                 backend: str = "sdpa", max_blocks_per_seq: int = 64):
        cfg = model.config
        self.model = model
        self.block_length = block_length
        self.device = device
        self.backend = backend
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_qo_heads = getattr(model, "num_local_heads", cfg.num_attention_heads)  # per TP rank
        self.num_kv_heads = getattr(model, "num_local_kv_heads", cfg.num_key_value_heads)
        # One page past the budget takes the K/V writes of padded graph rows.
        self.cache = KVCache(cfg.num_hidden_layers, num_pages + 1, block_length, self.num_kv_heads, cfg.head_dim,
                             dtype, device)
        self.scratch_page = num_pages
        self.scratch_slots = torch.arange(num_pages * block_length, (num_pages + 1) * block_length, device=device)
        self.attention = self._make_backend(backend)
        self.graphs: dict[tuple[int, int], DecodeGraph] = {}  # (blocks per row, batch size)
        self.graph_mode = "padded"
        self.on_step: Optional[Callable[[StepInputs], None]] = None  # TP rank 0: broadcast to the workers

    def _make_backend(self, backend: str):
        if backend == "sdpa":
            return SdpaAttention(self.cache)
        if backend == "flashinfer":
            from fluxlab.engine.layers.attention_flashinfer import FlashInferAttention

            return FlashInferAttention(self.cache, self.model.config, self.device,
                                       num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads)
        raise ValueError(f"attention.backend={backend} is not available in this build; use sdpa or flashinfer")

    @torch.inference_mode()
    def capture_decode_graphs(self, batch_sizes: list[int], mode: str = "padded") -> None:
        """Capture one decode graph per batch size (largest first, sharing one memory pool)."""
        if self.backend != "flashinfer":
            raise ValueError("decode CUDA graphs need attention.backend=flashinfer")
        self.graph_mode = mode
        started = time.perf_counter()
        free_before, _ = torch.cuda.mem_get_info(self.device)
        pool = torch.cuda.graph_pool_handle()
        for blocks in (2, 1):
            for batch_size in sorted(batch_sizes, reverse=True):
                self.graphs[blocks, batch_size] = DecodeGraph(self, batch_size, blocks, pool)
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        log.info("captured %d decode graphs %s (%s) in %.1f s using %.2f GiB", len(self.graphs), sorted(self.graphs),
                 mode, time.perf_counter() - started, (free_before - free_after) / 2**30)

    def release_graphs(self) -> None:
        """Drop the decode graphs (before a TP group is torn down: they hold captured collectives)."""
        if self.graphs:
            torch.cuda.synchronize(self.device)
            self.graphs.clear()

    def _graph_chunks(self, num_rows: int) -> Optional[list[int]]:
        """Captured sizes to run `num_rows` rows with: one padded size, or a decomposition."""
        sizes = sorted({size for _, size in self.graphs})
        if not sizes or num_rows > sizes[-1] and self.graph_mode == "padded":
            return None
        if self.graph_mode == "padded":
            return [next(s for s in sizes if s >= num_rows)]
        chunks, left = [], num_rows
        while left:
            fit = [s for s in sizes if s <= left]
            size = fit[-1] if fit else sizes[0]
            chunks.append(size)
            left -= min(size, left)
        return chunks

    def prepare(self, batch: ScheduledBatch) -> "StepInputs":
        """A scheduled batch as plain host data (what a TP worker receives from rank 0)."""
        bl = self.block_length
        token_ids, positions, rows = [], [], []
        for row in batch.rows:
            start = row.first_block * bl
            length = row.num_blocks * bl
            token_ids.extend(row.request.tokens[start:start + length])
            positions.extend(range(start, start + length))
            rows.append((row.first_block, row.num_blocks, row.decodes, list(row.request.page_table)))
        return StepInputs(token_ids, positions, rows)

    def run(self, batch: ScheduledBatch) -> Optional[torch.Tensor]:
        """One forward over every row; logits [rows that decode, block_length, vocab] in fp32."""
        inputs = self.prepare(batch)
        if self.on_step is not None:
            self.on_step(inputs)
        return self.execute(inputs)

    @torch.inference_mode()
    def execute(self, inputs: "StepInputs") -> Optional[torch.Tensor]:
        bl = self.block_length
        rows: Rows = [(first, n, table) for first, n, _, table in inputs.rows]
        ids = torch.tensor(inputs.token_ids, dtype=torch.long).to(self.device, non_blocking=True)
        pos = torch.tensor(inputs.positions, dtype=torch.long).to(self.device, non_blocking=True)
        blocks = inputs.rows[0][1]
        uniform = blocks <= 2 and all(decodes and n == blocks for _, n, decodes, _ in inputs.rows)
        chunks = self._graph_chunks(len(rows)) if uniform and self.graphs else None
        if chunks is not None:
            logits, done = [], 0
            span = blocks * bl
            for size in chunks:
                take = min(size, len(rows) - done)
                part = self.graphs[blocks, size].replay(self, ids[done * span:(done + take) * span],
                                                        pos[done * span:(done + take) * span], rows[done:done + take])
                # Graphs share one memory pool: copy a chunk out before the next replay reuses it.
                logits.append(part.clone() if len(chunks) > 1 else part)
                done += take
            out = torch.cat(logits) if len(logits) > 1 else logits[0]
            return out.view(-1, bl, out.shape[-1])
        self.attention.begin(build_metadata(rows, bl, self.device, dense=self.backend == "sdpa"))
        hidden = self.model(ids, pos, self.attention)
        logit_rows = self._last_block_rows(inputs)
        if logit_rows is None:
            return None
        logits = self.model.compute_logits(hidden[logit_rows])
        return logits.view(-1, bl, logits.shape[-1])

    def _last_block_rows(self, inputs: "StepInputs") -> Optional[torch.Tensor]:
        """Token indices of each decoding row's last block in an eager forward (graphs keep their own)."""
        bl = self.block_length
        index, offset = [], 0
        for _, n, decodes, _ in inputs.rows:
            if decodes:
                index.extend(range(offset + (n - 1) * bl, offset + n * bl))
            offset += n * bl
        return torch.tensor(index, dtype=torch.long).to(self.device, non_blocking=True) if index else None
