"""The model runner for Diffusion-Gemma: one mixed forward per step, then the canvas decoder.

`run(batch)` keeps ModelRunner's contract (a ScheduledBatch in, a StepOutput out, one
device->host copy): each row's final blocks (prompt chunks, the canvas just committed) run as
encoder tokens and write their K/V; its active block, when it decodes, is the request's current
canvas, denoised with no K/V write. The current canvas lives on the device in the request's
CanvasState (request.tokens' active block is its host mirror, written by postprocess); when a
canvas is final its tokens are the argmax canvas and the next forward commits them.

TPF: `filled` is 0 on a denoising step and, on the final one, the tokens that canvas adds to the
output (cut at max_new_tokens, EOS included), so tokens_accepted / forwards is transformers'
tokens_per_forward (accepted tokens per denoiser forward).

A batch whose rows all denoise their canvas, alone or right after committing one block, runs the
static path instead when it is enabled (`enable_denoise_graphs`, canvas_graphs.py): the same step
in fixed buffers, replayed as a CUDA graph; `can_run(batch)` is the seam, every other batch (a
prefill of several blocks, a commit without a canvas) runs eagerly here.

Memory: full-attention layers keep a page per canvas (request.page_table); sliding layers a ring
of `ring_size` pages (request.sliding_pages, canvas_pages.py), block b on ring[b % ring_size].
"""
from __future__ import annotations

import math
import time
from typing import Optional

import numpy as np
import torch

from fluxlab.models.diffusion_gemma.paged_attention import (CanvasKVCache, CanvasRow, PagedCanvasAttention,
                                             build_canvas_metadata)
from fluxlab.models.diffusion_gemma.graphs import CanvasGraphs
from fluxlab.models.diffusion_gemma.request import CanvasRequest
from fluxlab.models.diffusion_gemma.decoding import CanvasState, canvas_step
from fluxlab.engine.batch import ScheduledBatch, StepOutput


def kv_shapes(text_config) -> list[tuple[int, int]]:
    """(kv_heads, head_dim) per layer, as transformers' config gives them."""
    return [(c.num_key_value_heads, c.head_dim) for c in text_config.per_layer_config]


class CanvasRunner:
    def __init__(self, model, num_pages: int, num_sliding_pages: int, ring_size: int, canvas_length: int,
                 device: torch.device, dtype: torch.dtype, pages_per_seq: int, attention: str = "sdpa"):
        self.model = model
        self.pages_per_seq = pages_per_seq  # page-table capacity of a request (static buffers)
        self.block_length = canvas_length
        self.device = device
        self.dtype = dtype
        self.vocab_size = model.embed_tokens.num_embeddings
        self.ring_size = ring_size
        # blocks before the one being written that a later sliding query can still see
        self.window_blocks = math.ceil((model.sliding_window - 1) / canvas_length)
        # one scratch page past each pool: the commit graph's padding rows write their K/V there
        self.cache = CanvasKVCache(kv_shapes(model.config), model.layer_is_sliding, num_pages + 1,
                                   num_sliding_pages + 1, canvas_length, dtype, device)
        self.scratch_pages = {False: num_pages, True: num_sliding_pages}
        self._sliding_backup = None  # (slots, copies) a failed step puts back
        # attention=sdpa: gathered keys + masks + torch sdpa (CPU, the default); triton: the batch-invariant
        # kernel (kernels/canvas_attention.py) reads the pools in place, same masks (CUDA; validation says so)
        if attention not in ("sdpa", "triton"):
            raise ValueError(f"attention={attention!r}: Diffusion-Gemma runs sdpa or triton")
        self.attention = PagedCanvasAttention(self.cache, model.layer_is_sliding, kernel=attention == "triton")
        self.num_graph_forwards = 0
        self.num_eager_forwards = 0
        self.launched_at = self.results_at = 0.0
        self.on_step = None  # no tensor parallelism for this model
        self.special: dict[str, int] = {}
        self.step_elements = 2**28  # logits elements per decode chunk (1 GiB of fp32)
        self.graphs: Optional[CanvasGraphs] = None  # the static denoising path, when enabled
        hidden = model.embed_tokens.embedding_dim
        self.zero_soft = torch.zeros(canvas_length, hidden, dtype=dtype, device=device)  # a canvas' first step
        self.no_argmax = torch.full((canvas_length,), -1, dtype=torch.long, device=device)
        self.zero_run = torch.zeros((), dtype=torch.long, device=device)

    def enable_denoise_graphs(self, row_sizes: list[int], capture: bool) -> None:
        """Canvas batches of at most max(row_sizes) rows (`CanvasGraphs.can_run`) run the static
        path: CUDA graphs (capture=True) or the same padded buffers called as is (capture=False)."""
        self.graphs = CanvasGraphs(self, row_sizes, capture)

    # --- host side ---
    def _rows(self, batch: ScheduledBatch):
        L, window = self.block_length, self.model.sliding_window
        rows, token_ids, positions, canvas_at, decoding, at_risk = [], [], [], [], [], []
        offset = 0
        for row in batch.rows:
            request: CanvasRequest = row.request
            table = np.asarray(request.page_table, dtype=np.int64)
            ring = np.asarray(request.sliding_pages, dtype=np.int64)
            enc_start = max(row.first_block * L, request.num_pad)
            enc_end = (row.first_block + row.num_commit_blocks) * L
            ids = request.tokens[enc_start:enc_end]
            index = np.arange(request.num_pad, enc_end)
            key_slots = table[index // L] * L + index % L
            sliding_slots = ring[index // L % self.ring_size] * L + index % L if len(index) else index
            # the ring stores the blocks a later query sees: from enc_end / L - window_blocks on
            sliding_writes = np.flatnonzero(np.arange(enc_start, enc_end) >= enc_end - self.window_blocks * L)
            if len(ids):  # a chunk of several blocks may reuse slots it reads: a failed step puts them back
                first_read = max(0, enc_start - request.num_pad - (window - 1))
                read = sliding_slots[first_read:enc_start - request.num_pad]
                written = sliding_slots[enc_start - request.num_pad:][sliding_writes]
                at_risk.append(np.intersect1d(read, written))
            encoder_tokens = offset + np.arange(len(ids))
            token_ids.append(ids)
            positions.append(np.arange(enc_start, enc_end) - request.num_pad)
            offset += len(ids)
            canvas_tokens = np.zeros(0, dtype=np.int64)
            if row.decodes:
                start = request.active_block * L - request.num_pad
                canvas_tokens = offset + np.arange(L)
                canvas_at.append(offset)
                token_ids.append(np.zeros(L, dtype=np.int64))  # filled on the device from the state
                positions.append(np.arange(start, start + L))
                decoding.append(request)
                offset += L
            rows.append(CanvasRow(key_slots, encoder_tokens, canvas_tokens, sliding_slots, sliding_writes))
        at_risk = np.concatenate(at_risk) if at_risk else np.zeros(0, dtype=np.int64)
        return rows, np.concatenate(token_ids), np.concatenate(positions), canvas_at, decoding, at_risk

    def _state(self, request: CanvasRequest) -> CanvasState:
        if request.canvas is None:
            request.canvas = CanvasState(request.params.seed, self.device)
        state = request.canvas
        if state.needs_canvas:  # a new canvas starts: its uniform random tokens, from the request's generator
            state.canvas = state.draw_canvas(self.vocab_size, self.block_length)
            state.enter_canvas()
            state.needs_canvas = False
        return state

    # --- the forward and the decode step ---
    def run(self, batch: ScheduledBatch) -> Optional[StepOutput]:
        """One forward and canvas step. A step that raises leaves every row's canvas state (and its
        generator) as it was, so the engine's retry of each row alone draws the same numbers."""
        decoding = [row.request for row in batch.rows if row.decodes]
        saved = [(r, r.canvas.snapshot() if r.canvas is not None else None) for r in decoding]
        self._sliding_backup = None
        try:
            return self._run(batch)
        except BaseException:
            if self._sliding_backup is not None:
                self.cache.restore_sliding(*self._sliding_backup)
            for request, snapshot in saved:
                if snapshot is None:
                    request.canvas = None
                else:
                    request.canvas.restore(snapshot)
            raise

    @torch.inference_mode()
    def _run(self, batch: ScheduledBatch) -> Optional[StepOutput]:
        if self.graphs is not None and self.graphs.can_run(batch):
            return self._run_static(batch)
        L = self.block_length
        rows, token_ids, positions, canvas_at, decoding, at_risk = self._rows(batch)
        if at_risk.size:
            slots = torch.from_numpy(at_risk).to(self.device)
            self._sliding_backup = (slots, self.cache.save_sliding(slots))
        states = [self._state(r) for r in decoding]
        ids = torch.from_numpy(token_ids.astype(np.int64)).to(self.device)
        pos = torch.from_numpy(positions.astype(np.int64)).to(self.device)
        is_canvas = torch.zeros(len(token_ids), dtype=torch.bool, device=self.device)
        soft = None
        if decoding:
            canvas_index = torch.from_numpy(np.concatenate([a + np.arange(L) for a in canvas_at])).to(self.device)
            ids.index_copy_(0, canvas_index, torch.cat([s.canvas for s in states]))
            is_canvas[canvas_index] = True
            if any(s.soft_embeds is not None for s in states):
                hidden_size = self.model.embed_tokens.embedding_dim
                zeros = torch.zeros(L, hidden_size, dtype=self.dtype, device=self.device)
                soft = torch.cat([s.soft_embeds if s.soft_embeds is not None else zeros for s in states])
        self.attention.begin(build_canvas_metadata(rows, L, self.model.sliding_window, self.device,
                                                   masks=not self.attention.kernel))
        self.launched_at = time.perf_counter()
        self.num_eager_forwards += 1
        hidden = self.model(ids, pos, self.attention, is_canvas, soft)
        if not decoding:
            return None
        canvas_hidden = hidden[canvas_index].view(len(decoding), L, -1)
        blocks, finals = [], []
        # Rows in chunks: the step holds several [rows, L, vocab] fp32 tensors (26B-A4B: 256 MiB a row
        # each); every op is per row, so chunking changes no value.
        chunk = max(1, self.step_elements // (L * self.vocab_size))
        for lo in range(0, len(decoding), chunk):
            hi = min(lo + chunk, len(decoding))
            logits = self.model.head(canvas_hidden[lo:hi].flatten(0, 1)).view(hi - lo, L, -1)
            block, final = self._step_rows(logits, decoding[lo:hi], states[lo:hi])
            blocks.append(block)
            finals.append(final)
        return self._finish(decoding, states, torch.cat(blocks), torch.cat(finals))

    def _step_rows(self, logits: torch.Tensor, requests: list[CanvasRequest],
                   states: list[CanvasState]) -> tuple[torch.Tensor, torch.Tensor]:
        """The canvas step of these rows: (block [n, L], final [n]); stores each state's canvas and
        self-conditioning input. Rows with a grammar take the canvas rule (constrained.py), the others
        the plain step with the ops they take in a batch without constrained rows (every op is per row)."""
        held = [i for i, r in enumerate(requests) if r.constraint is not None]
        if not held:
            return self._store(self._plain_step(logits, requests, states), states)
        from fluxlab.models.diffusion_gemma.constrained import constrained_canvas_step

        block = torch.empty(len(requests), self.block_length, dtype=torch.long, device=logits.device)
        final = torch.empty(len(requests), dtype=torch.bool, device=logits.device)
        free = [i for i in range(len(requests)) if requests[i].constraint is None]
        for rows in (free, held):
            if not rows:
                continue
            at = torch.tensor(rows, device=logits.device)
            part_logits, part_requests, part_states = logits.index_select(0, at), [requests[i] for i in rows], \
                [states[i] for i in rows]
            if rows is held:
                step = constrained_canvas_step(part_logits, part_requests, part_states,
                                               self.model.final_logit_softcapping)
            else:
                step = self._plain_step(part_logits, part_requests, part_states)
            part_block, part_final = self._store(step, part_states)
            block.index_copy_(0, at, part_block)
            final.index_copy_(0, at, part_final)
        return block, final

    def _plain_step(self, logits: torch.Tensor, requests: list[CanvasRequest], states: list[CanvasState]):
        return canvas_step(logits, torch.stack([s.canvas for s in states]), states, [r.knobs for r in requests],
                           inplace=True, raw=True, softcap=self.model.final_logit_softcapping)

    def _store(self, step, states: list[CanvasState]) -> tuple[torch.Tensor, torch.Tensor]:
        soft_next = self.model.soft_embed_probs(step.probs)
        for i, s in enumerate(states):
            s.canvas = step.block[i]
            s.soft_embeds = soft_next[i]
        return step.block, step.final

    def _run_static(self, batch: ScheduledBatch) -> StepOutput:
        decoding = list(batch.requests)
        commits = (batch.num_blocks == 2).tolist()
        states = [self._state(r) for r in decoding]
        self.launched_at = time.perf_counter()
        if self.graphs.capture:
            self.num_graph_forwards += 1
        else:
            self.num_eager_forwards += 1
        block, final = self.graphs.run(decoding, states, commits)
        return self._finish(decoding, states, block, final)

    def _finish(self, decoding: list[CanvasRequest], states: list[CanvasState], block: torch.Tensor,
                final: torch.Tensor) -> StepOutput:
        L = self.block_length
        host = torch.cat([block, final[:, None].long()], dim=1).cpu().numpy()  # one copy
        self.results_at = time.perf_counter()
        blocks, final = host[:, :L], host[:, L].astype(bool)
        filled = np.zeros(len(decoding), dtype=np.int64)
        for i, request in enumerate(decoding):
            if final[i]:
                states[i].needs_canvas = True
                filled[i] = self._committed_tokens(request, blocks[i])
        zeros = np.zeros(len(decoding), dtype=np.int64)
        return StepOutput(blocks, filled, zeros, final)

    @staticmethod
    def _committed_tokens(request: CanvasRequest, canvas: np.ndarray) -> int:
        """Tokens a final canvas adds to the output: up to max_new_tokens, through the first EOS."""
        start = request.active_block * request.block_length
        room = request.num_prompt_tokens + request.params.max_new_tokens - start
        new = canvas[:max(0, min(len(canvas), room))].tolist()
        if not request.params.ignore_eos:
            stops = [new.index(e) for e in request.eos_ids if e in new]
            if stops:
                return min(stops) + 1
        return len(new)

    def invalidate_step_state(self) -> None:
        """Nothing to rewrite: canvas state lives on each request."""

    def release_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
