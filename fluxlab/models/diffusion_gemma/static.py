"""The canvas step of R rows with static shapes: what a Diffusion-Gemma CUDA graph holds.

Most steps of canvas decoding denoise each row's canvas alone (no K/V written); the rest commit
the canvas just accepted and denoise the next one in the same forward. Both depend on a few
numbers per row: the canvas and its self-conditioning input, the prefix length K, the left
padding, the page tables (and the block a row commits). `StaticDenoiser` keeps those in fixed
buffers of R rows and computes everything else on the device from them: cache slots and masks
(`StaticCanvasAttention`), the forward (`DiffusionGemmaModel.forward_canvas`), the logits, the
canvas sampler (`denoise_step`) and the next self-conditioning input. Rows past the batch are
padding: K = 0 (they see only their own canvas), page 0 read and masked out, temperature 1; in
the commit graph they (and rows committing nothing) write a dummy block to a scratch page.

Keys: full-attention layers gather `key_pages * L` prefix keys a row (a power-of-two bucket of the
batch's longest prefix, canvas_graphs.py), sliding layers `window - 1` (+ L in the commit graph);
keys past a row's K are masked. The eager path pads every row to its batch's longest prefix the
same way, so values agree with it to fp32 rounding (CPU sdpa blocks a longer key axis
differently) and tokens are transformers' (the CPU tests run this path against its generate()).

Randomness: row r draws from generators[r]. On CPU (and the un-captured path) those are the
requests' own generators. Under a CUDA graph they are R generators registered with the graph
(`CUDAGraph.register_generator_state`): a replay reads each one's seed and Philox offset from
device memory and advances the offset by what capture consumed, so copying a request's state into
slot r before the replay and back after it (`get_state`/`set_state`, host-side bytes, no sync)
makes the graph draw exactly the numbers the eager kernels draw from that request's generator,
in the same order (its multinomial's Exp(1) noise, then its renoise canvas). The draws stay in
the graph: keeping them outside would split it in three and add a host round trip per row.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from fluxlab.kernels import pdl
from fluxlab.kernels.tma import graph_tiles
from fluxlab.models.diffusion_gemma.paged_attention import CanvasKVCache
from fluxlab.models.diffusion_gemma.request import CanvasRequest
from fluxlab.models.diffusion_gemma.decoding import CanvasState, CanvasStepInputs, denoise_step


class StaticCanvasAttention:
    """The model's `attn.forward(layer_idx, q, k, v)` for R rows of Q = E + L queries each: E
    encoder tokens (0, or L for the commit graph: the block a row commits, or dummies writing to
    the scratch page) then its canvas. `plan` derives slots and masks on the device from the
    per-row buffers. Every layer writes the encoder K/V first, then gathers the prefix (the
    just-written block included: a single-block write never reuses a ring slot this forward
    reads, canvas_pages.py), so both layer types read the same way."""

    def __init__(self, cache: CanvasKVCache, layer_is_sliding: list[bool], rows: int, canvas_length: int,
                 window: int, encoder_tokens: int, full_keys: int, sliding_keys: int, ring_size: int,
                 scratch_pages: dict[bool, int], kernel: bool = False):
        self.cache = cache
        self.kernel = kernel  # kernels/canvas_attention.py instead of cat + sdpa (attention=triton)
        self.layer_is_sliding = layer_is_sliding
        self.rows, self.L, self.window, self.ring_size = rows, canvas_length, window, ring_size
        self.E = encoder_tokens
        self.num_keys = {False: full_keys, True: sliding_keys}
        self.scratch_pages = scratch_pages
        self.slots: dict[bool, torch.Tensor] = {}
        self.write_slots: dict[bool, torch.Tensor] = {}
        self.masks: dict[bool, torch.Tensor] = {}
        self.geometry: dict[bool, torch.Tensor] = {}  # the kernel's [4, R]: K, E, E + L, first prefix position
        if kernel:  # row r's tokens sit at r * (E + L) .. : its queries, then its canvas keys after E
            device = cache.k[0].device
            Q = encoder_tokens + canvas_length
            self.query_index = torch.arange(rows * Q, device=device).view(rows, Q)
            self.canvas_index = self.query_index[:, encoder_tokens:].contiguous()

    def plan(self, prefix: torch.Tensor, encoder: torch.Tensor, num_pad: torch.Tensor, page_table: torch.Tensor,
             ring: torch.Tensor) -> None:
        """prefix [R]: the canvas' prefix keys (after this forward's writes); encoder [R]: E where
        the row commits a block at positions prefix - E .. prefix - 1, else 0."""
        L, E, device = self.L, self.E, prefix.device
        K, pad, ne = prefix[:, None], num_pad[:, None], encoder[:, None]
        query = torch.arange(E + L, device=device)[None, :, None]  # [1, Q, 1]
        is_encoder = query < E
        q_pos = K[:, :, None] - E + query  # [R, Q, 1]: encoder queries sit at the positions they write
        for sliding in (False, True):
            pages_of = ((lambda i: ring.gather(1, i // L % self.ring_size)) if sliding
                        else (lambda i: page_table.gather(1, i // L)))
            if E:
                # (clamped: a row committing nothing may sit before position E; its slots are the scratch's)
                written = (K - E + torch.arange(E, device=device)[None, :] + pad).clamp(min=0)
                scratch = self.scratch_pages[sliding] * L + torch.arange(E, device=device)[None, :]
                self.write_slots[sliding] = torch.where(ne > 0, pages_of(written) * L + written % L, scratch).flatten()
            # logical prefix positions gathered: from 0, or the oldest a sliding query of the row sees
            first = (K - ne - (self.window - 1)).clamp(min=0) if sliding else torch.zeros_like(K)
            pos = first + torch.arange(self.num_keys[sliding], device=device)[None, :]
            index = pos + pad  # into the request's (left-padded) token array
            self.slots[sliding] = pages_of(index) * L + index % L
            if self.kernel:  # the same masks, from four numbers a row (a dummy encoder query may see nothing: zeros)
                self.geometry[sliding] = torch.stack([prefix, torch.full_like(prefix, E),
                                                      torch.full_like(prefix, E + L), first[:, 0]])
                continue
            key_pos = pos[:, None, :]  # [R, 1, K_t]
            valid = key_pos < K[:, :, None]
            canvas = valid & (key_pos >= K[:, :, None] - (self.window - 1)) if sliding else valid
            prefix_visible = canvas.expand(-1, E + L, -1)
            if E:
                causal = valid & (key_pos <= q_pos)
                if sliding:
                    causal = causal & (key_pos > q_pos - self.window)
                prefix_visible = torch.where(is_encoder, causal, prefix_visible)
            own_canvas = (~is_encoder).expand(self.rows, -1, L)  # canvas queries see the whole canvas
            mask = torch.cat([own_canvas, prefix_visible], dim=-1)  # canvas keys first (the eager path's order)
            if E:  # a dummy encoder query (a row that commits nothing) sees one key: softmax stays finite
                mask[..., L] |= is_encoder[..., 0] & (ne == 0)
            self.masks[sliding] = mask[:, None].contiguous()

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        sliding = self.layer_is_sliding[layer_idx]
        rows, L, E = self.rows, self.L, self.E
        cache_k, cache_v = self.cache.k[layer_idx], self.cache.v[layer_idx]
        k, v = k.view(rows, E + L, *k.shape[1:]), v.view(rows, E + L, *v.shape[1:])
        if E:
            cache_k[self.write_slots[sliding]] = k[:, :E].flatten(0, 1)
            cache_v[self.write_slots[sliding]] = v[:, :E].flatten(0, 1)
        slots = self.slots[sliding]
        if self.kernel:
            from fluxlab.kernels.canvas_attention import canvas_attention

            return canvas_attention(q, k.flatten(0, 1), v.flatten(0, 1), cache_k, cache_v, self.query_index,
                                    self.canvas_index, slots, self.geometry[sliding], self.window if sliding else 0)
        keys = torch.cat([k[:, E:], cache_k[slots]], dim=1)  # canvas first: PagedCanvasAttention.forward says why
        values = torch.cat([v[:, E:], cache_v[slots]], dim=1)
        queries = q.view(rows, E + L, *q.shape[1:])
        out = torch.nn.functional.scaled_dot_product_attention(
            queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=self.masks[sliding], scale=1.0, enable_gqa=True)
        return out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])


class StaticDenoiser:
    """Fixed buffers for `rows` canvas rows, each after `encoder_tokens` (0, or L: a block it may
    commit in the same forward), whose full layers gather `key_pages` pages of prefix, and the step
    over them: captured as a CUDA graph (`capture=True`) or called as is."""

    def __init__(self, runner, rows: int, key_pages: int, capture: bool, pool=None, with_sampler: bool = True,
                 encoder_tokens: int = 0):
        model, L, device = runner.model, runner.block_length, runner.device
        self.runner, self.model, self.rows, self.L, self.device = runner, model, rows, L, device
        self.key_pages, self.with_sampler, self.E = key_pages, with_sampler, encoder_tokens
        hidden = model.embed_tokens.embedding_dim
        self.canvas = torch.zeros(rows, L, dtype=torch.long, device=device)
        self.encoder_ids = torch.zeros(rows, encoder_tokens, dtype=torch.long, device=device)
        self.soft = torch.zeros(rows, L, hidden, dtype=runner.dtype, device=device)
        self.geometry = torch.zeros(3, rows, dtype=torch.long, device=device)  # prefix K, encoder tokens, left pad
        self.page_table = torch.zeros(rows, runner.pages_per_seq, dtype=torch.long, device=device)
        self.ring = torch.zeros(rows, runner.ring_size, dtype=torch.long, device=device)
        self.floats = torch.ones(3, rows, dtype=torch.float32, device=device)  # CanvasStepInputs.host_values
        self.ints = torch.zeros(2, rows, dtype=torch.long, device=device)
        self.prev_argmax = torch.full((rows, L), -1, dtype=torch.long, device=device)
        self.stable_run = torch.zeros(rows, dtype=torch.long, device=device)
        sliding_keys = max(1, min(model.sliding_window - 1 + encoder_tokens, (runner.pages_per_seq - 1) * L))
        self.attention = StaticCanvasAttention(runner.cache, model.layer_is_sliding, rows, L, model.sliding_window,
                                               encoder_tokens, key_pages * L, sliding_keys, runner.ring_size,
                                               runner.scratch_pages, kernel=runner.attention.kernel)
        self.generators = [torch.Generator(device=device) for _ in range(rows)]  # the graph's draw slots
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        if capture:
            # GEMMs take TMA tiles (kernels/tma.py), compiled in the warm-up; PDL by size (kernels/pdl.py)
            with graph_tiles(), pdl.forward_of(rows * (encoder_tokens + L)):
                for _ in range(2):  # warm up outside the graph (allocator, lazy inits, kernels)
                    self._step(self.generators)
                torch.cuda.synchronize(device)
                self.graph = torch.cuda.CUDAGraph()
                for g in self.generators:
                    self.graph.register_generator_state(g)
                # thread_local: a serving thread that touches CUDA during a (lazy) capture does not void it
                with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
                    self.out = self._step(self.generators)

    def _step(self, generators: list[torch.Generator]) -> tuple:
        """(block [R, L], final [R], argmax [R, L], stable_run [R], soft_next [R, L, H]) from the buffers."""
        model, rows, L, E = self.model, self.rows, self.L, self.E
        prefix, encoder, num_pad = self.geometry
        self.attention.plan(prefix, encoder, num_pad, self.page_table, self.ring)
        positions = (prefix[:, None] - E + torch.arange(E + L, device=self.device)).flatten()
        if E:
            ids = torch.cat([self.encoder_ids, self.canvas], dim=1).flatten()
            soft = torch.cat([torch.zeros_like(self.soft[:, :E]), self.soft], dim=1).flatten(0, 1)
            is_canvas = (torch.arange(E + L, device=self.device) >= E).repeat(rows)
            hidden = model.forward_canvas(ids, positions, self.attention, soft, is_canvas)
            hidden = hidden.view(rows, E + L, -1)[:, E:]
        else:
            hidden = model.forward_canvas(self.canvas.flatten(), positions, self.attention,
                                          self.soft.flatten(0, 1)).view(rows, L, -1)
        parts = []
        chunk = max(1, self.runner.step_elements // (L * self.runner.vocab_size))  # the eager path's chunks
        for lo in range(0, rows, chunk):
            hi = min(lo + chunk, rows)
            if not self.with_sampler:  # the bench's forward-only graph: the forward and its logits
                model.compute_logits(hidden[lo:hi].flatten(0, 1))
                continue
            logits = model.head(hidden[lo:hi].flatten(0, 1)).view(hi - lo, L, -1)
            inputs = CanvasStepInputs(self.floats[0, lo:hi], self.floats[1, lo:hi], self.floats[2, lo:hi],
                                      self.ints[0, lo:hi], self.ints[1, lo:hi].bool(), self.prev_argmax[lo:hi],
                                      self.stable_run[lo:hi])
            step = denoise_step(logits, self.canvas[lo:hi], inputs, generators[lo:hi], inplace=True, raw=True,
                                softcap=model.final_logit_softcapping)
            parts.append((step.block, step.final, step.argmax, step.stable_run, model.soft_embed_probs(step.probs)))
        if not parts:
            return ()
        return tuple(torch.cat(p) if len(parts) > 1 else p[0] for p in zip(*parts))

    def load(self, requests: list[CanvasRequest], states: list[CanvasState], commits: list[bool]) -> None:
        """Copy n <= R rows into the buffers (commits[i]: row i writes its block active_block - 1
        first); rows past n become padding."""
        n, L = len(requests), self.L
        geometry = np.zeros((3, self.rows), dtype=np.int64)
        table = np.zeros(self.page_table.shape, dtype=np.int64)
        ring = np.zeros(self.ring.shape, dtype=np.int64)
        encoder_ids = np.zeros(self.encoder_ids.shape, dtype=np.int64)
        for i, (request, commit) in enumerate(zip(requests, commits)):
            geometry[:, i] = max(0, request.active_block * L - request.num_pad), L if commit else 0, request.num_pad
            table[i, :len(request.page_table)] = request.page_table
            ring[i, :len(request.sliding_pages)] = request.sliding_pages
            if commit:
                start = (request.active_block - 1) * L
                encoder_ids[i] = request.tokens[start:start + L]
        floats, ints = CanvasStepInputs.host_values(states, [r.knobs for r in requests])
        host_floats = np.ones((3, self.rows), dtype=np.float32)
        host_floats[:, :n] = floats
        host_ints = np.zeros((2, self.rows), dtype=np.int64)
        host_ints[:, :n] = ints
        for buffer, array in ((self.geometry, geometry), (self.page_table, table), (self.ring, ring),
                              (self.floats, host_floats), (self.ints, host_ints), (self.encoder_ids, encoder_ids)):
            buffer.copy_(torch.from_numpy(array), non_blocking=True)
        self.canvas[:n] = torch.stack([s.canvas for s in states])
        zeros = self.runner.zero_soft
        self.soft[:n] = torch.stack([s.soft_embeds if s.soft_embeds is not None else zeros for s in states])
        self.prev_argmax[:n] = torch.stack([s.prev_argmax if s.prev_argmax is not None else self.runner.no_argmax
                                            for s in states])
        self.stable_run[:n] = torch.stack([s.stable_run if s.stable_run is not None else self.runner.zero_run
                                           for s in states])
        if n < self.rows:
            self.soft[n:] = 0
            self.prev_argmax[n:] = -1
            self.stable_run[n:] = 0

    def run(self, requests: list[CanvasRequest], states: list[CanvasState],
            commits: Optional[list[bool]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One denoising step of these rows (and the commits their rows carry): (block [n, L],
        final [n]) on the device; each state takes its new canvas, self-conditioning input,
        stopping history and generator position."""
        n = len(requests)
        self.load(requests, states, commits or [False] * n)
        if self.graph is None:
            out = self._step([s.generator for s in states] + self.generators[n:])
        else:
            for slot, s in zip(self.generators, states):
                slot.set_state(s.generator.get_state())
            self.graph.replay()
            for slot, s in zip(self.generators, states):
                s.generator.set_state(slot.get_state())
            out = self.out
        if not self.with_sampler:
            return None, None
        # copies: the buffers are the next replay's; one copy each, rows are views of it
        block, final, argmax, run, soft = (t[:n].clone() for t in out)
        for i, s in enumerate(states):
            s.canvas, s.soft_embeds, s.prev_argmax, s.stable_run = block[i], soft[i], argmax[i], run[i]
            s.forwards += 1
        return block, final
