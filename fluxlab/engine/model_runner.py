"""The only owner of device tensors: weights, KV pages, step state, CUDA graphs, the forward, the
logits head and the decode step.

`run(batch)` = `launch` (prepare_forward: host arrays, numpy -> the forward: its inputs read by a
replaying graph from host memory, else one host->device copy) -> `finish` (prepare_decode, while
the forward runs: the decoding rows and the positions whose logits they need -> the logits head at
those positions -> decode, on the device -> one device->host copy of the new blocks). `finish` may
launch the next forward of the same rows as soon as its results show that no row finished its
block (the engine's async scheduling): the GPU then runs while the host applies the results.
Under TP / DP attention rank 0 prepares the whole step before the launch (the step message carries
the logit rows) and every rank calls `execute`.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import numpy as np
import torch

from fluxlab.engine.constraint.rule import BlockGuard, apply_repair
from fluxlab.engine.decoding.registry import DECODERS
from fluxlab.engine.decoding.base import DecodeBatch
from fluxlab.engine.decoding.step import decode
from fluxlab.engine.layers.moe import check_routing_blocks
from fluxlab.engine.layers.backends import FP8_KV_BACKENDS, GRAPH_BACKENDS
from fluxlab.engine.layers.attention import AttentionMetadata, SdpaAttention, build_metadata
from fluxlab.engine.layers.kv_fp8 import make_kv_cache
from fluxlab.engine.layers.segments import Segments
from fluxlab.engine.runner_inputs import DecodeInputs, Launched, RowArrays, StepInputs
from fluxlab.engine.batch import ScheduledBatch, StepOutput
from fluxlab.engine.sequence import Request
from fluxlab.engine.staging import HostStaging
from fluxlab.engine.step_state import StepState

log = logging.getLogger("fluxlab.engine")


class ModelRunner:
    def __init__(self, model, num_pages: int, block_length: int, device: torch.device, dtype: torch.dtype,
                 backend: str = "sdpa", max_blocks_per_seq: int = 64, max_num_seqs: int = 8, mask_id: int = 0,
                 special: Optional[dict[str, int]] = None, kv_cache_dtype: str = "auto"):
        cfg = model.config
        self.model = model
        self.block_length = block_length
        self.device = device
        self.dtype = dtype
        self.backend = backend
        self.max_blocks_per_seq = max_blocks_per_seq
        self.mask_id = mask_id
        self.special = dict(special or {})  # extra token ids decoders read (delete_id, split_id)
        self.routing_block_size = getattr(cfg, "routing_block_size", 0) or 0
        self.num_qo_heads = getattr(model, "num_local_heads", cfg.num_attention_heads)  # per TP rank
        self.num_kv_heads = getattr(model, "num_local_kv_heads", cfg.num_key_value_heads)
        # One page past the budget takes the K/V writes of padded graph rows.
        self.cache = make_kv_cache(kv_cache_dtype, cfg.num_hidden_layers, num_pages + 1, block_length,
                                   self.num_kv_heads, cfg.head_dim, dtype, device)
        self.scratch_page = num_pages
        self.scratch_slots = torch.arange(num_pages * block_length, (num_pages + 1) * block_length, device=device)
        self._flashinfer_workspace = None  # one for every FlashInfer wrapper (eager and graphs)
        self.attention = self._make_backend(backend)
        self.step_state = StepState(max_num_seqs, device, block_length)
        self.graphs = None  # GraphRunner once captured
        self.num_graph_forwards = 0
        self.num_eager_forwards = 0
        # perf_counter() when the last forward was launched and when its results reached the host:
        # the host time a step costs the GPU is (launch - step start) + (step end - results).
        self.launched_at = self.results_at = 0.0
        self.staging = HostStaging(device)
        self._block_offsets = np.arange(block_length)[None, :]  # [1, bl]
        self._iota = np.arange(0)  # 0, 1, 2, ...: read-only views instead of a new arange each step
        self._rows: Optional[RowArrays] = None  # the last batch's, for a batch of the same rows
        self._no_logits = np.zeros(0, dtype=np.int64)  # StepInputs.logit_index until prepare_decode
        # The last decode step's device tensors, freed after the next launch: ~30 caching-allocator frees
        # cost the GPU's host ~0.1 ms, which the GPU would otherwise idle through before postprocess.
        self._retired: Optional[tuple] = None
        # Greedy rows read model-dtype logits through the one-pass kernel on CUDA; fp32 elsewhere.
        self.fp32_logits = device.type != "cuda" or dtype == torch.float32
        self.on_step: Optional[Callable[[StepInputs], None]] = None  # TP rank 0: broadcast to the workers

    def _make_backend(self, backend: str, graph_segments: int = 0):
        """The attention backend; graph_segments > 0: one with fixed buffers for a graph of that many segments."""
        if self.cache.quantized and backend not in FP8_KV_BACKENDS:
            raise ValueError(f"model.kv_cache_dtype=fp8_e4m3 with attention.backend={backend}: only "
                             f"{' and '.join(FP8_KV_BACKENDS)} read FP8 KV pages; use attention=triton or attention=sdpa")
        if backend == "sdpa":
            return SdpaAttention(self.cache)
        if backend == "flashinfer":
            from fluxlab.engine.layers.attention_flashinfer import FlashInferAttention, SharedWorkspace

            if self._flashinfer_workspace is None:
                self._flashinfer_workspace = SharedWorkspace(self.device)
            return FlashInferAttention(self.cache, self.model.config, self.device,
                                       num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                                       graph_segments=graph_segments,
                                       graph_max_pages=graph_segments * self.max_blocks_per_seq,
                                       workspace=self._flashinfer_workspace)
        if backend in ("fa4", "triton"):
            if backend == "fa4":
                from fluxlab.engine.layers.attention_fa4 import Fa4Attention as PageTableBackend
            else:
                from fluxlab.engine.layers.attention_triton import TritonAttention as PageTableBackend
            return PageTableBackend(self.cache, self.device, num_qo_heads=self.num_qo_heads,
                                    head_dim=self.model.config.head_dim, max_blocks_per_seq=self.max_blocks_per_seq,
                                    graph_segments=graph_segments)
        raise ValueError(f"attention.backend={backend} is not available in this build; "
                         "use sdpa, flashinfer, fa4 or triton")

    # --- graphs ---
    @torch.inference_mode()
    def capture_graphs(self, segment_sizes: list[int], mode: str = "padded") -> None:
        from fluxlab.engine.graph_runner import GraphRunner

        if self.backend not in GRAPH_BACKENDS:
            raise ValueError(f"CUDA graphs need attention.backend={' or '.join(GRAPH_BACKENDS)} (got {self.backend})")
        self.graphs = GraphRunner(self, segment_sizes, mode)

    def release_graphs(self) -> None:
        """Drop the graphs (before a TP group is torn down: they hold captured collectives)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    # --- host side ---
    def _range(self, n: int) -> np.ndarray:
        """np.arange(n) as a view of a cached array (callers never write to it)."""
        if self._iota.shape[0] < n:
            self._iota = np.arange(max(n, 2 * self._iota.shape[0]))
            self._iota.flags.writeable = False
        return self._iota[:n]

    def _block_rows(self, num_blocks: int) -> np.ndarray:
        """[num_blocks, bl] the flat indices of blocks 0.. (a view: a row gather beats broadcasting)."""
        return self._range(num_blocks * self.block_length).reshape(num_blocks, self.block_length)

    def prepare(self, batch: ScheduledBatch) -> tuple[StepInputs, Optional[DecodeInputs]]:
        """A scheduled batch as host arrays: what every rank runs, and what rank 0 decodes
        (`prepare_forward`, then `prepare_decode`)."""
        inputs = self.prepare_forward(batch)
        return inputs, self.prepare_decode(batch, inputs)

    def prepare_forward(self, batch: ScheduledBatch, tokens: Optional[np.ndarray] = None) -> StepInputs:
        """The forward's inputs (tokens, positions, segments; no logit rows yet). Every index is
        computed with numpy over the batch's seats (seats.py), no loop over rows; what depends on
        the rows alone is reused while the scheduler hands the same rows again. `tokens`: the
        query blocks [S, bl] in place of the seats' (a batch of single blocks)."""
        rows = self._rows
        if not (batch.same_rows and rows is not None and rows.slots is batch.slots
                and rows.first_block is batch.first_block):
            rows = self._rows = self._row_arrays(batch)
        if tokens is None:
            token_ids = batch.seats.block_rows.take(rows.block_row, axis=0).ravel()
        else:
            assert batch.single_blocks and tokens.shape == (rows.block_row.shape[0], self.block_length)
            token_ids = tokens.ravel()
        return StepInputs(token_ids, rows.positions, rows.tp_rows, self._no_logits, seats=rows.tp_seats,
                          segments=rows.segments)

    def prepare_decode(self, batch: ScheduledBatch, inputs: StepInputs) -> Optional[DecodeInputs]:
        """The decoding rows of the batch `prepare_forward` just prepared, and the forward's logit
        rows (set on `inputs`); None when no row decodes. On one GPU this runs while the forward does."""
        rows = self._rows
        if rows.seat is None:  # prefill chunks only
            return None
        bl = self.block_length
        num_rows = rows.seat.shape[0]
        token_ids = inputs.token_ids
        blocks = (token_ids if batch.single_blocks else token_ids[rows.block_index]).reshape(num_rows, bl)
        # Greedy logits only where a decoder may write: masks, or every non-prompt position of an
        # editing decoder.
        need = rows.greedy_if_masked & (blocks == self.mask_id)
        if rows.greedy_always is not None:
            need |= rows.greedy_always
        greedy_target = need.ravel().nonzero()[0]
        logit_index = rows.block_index[greedy_target]
        if rows.full_rows.shape[0]:
            logit_index = np.concatenate([logit_index, rows.full_index])
        inputs.logit_index, inputs.num_greedy = logit_index, len(greedy_target)
        return DecodeInputs(rows.requests, rows.seat, rows.block_index, greedy_target, rows.full_rows,
                            batch.seats.log_len[rows.seat], rows.decoders, rows.owners, rows.constrained)

    def _row_arrays(self, batch: ScheduledBatch) -> "RowArrays":
        bl = self.block_length
        seats = batch.seats
        slots, first, num = batch.slots, batch.first_block, batch.num_blocks
        if batch.single_blocks:  # one query block per row, its active block (most decode steps)
            block_ends = self._range(slots.shape[0] + 1)[1:]
            block_seat, query_block = slots, first
        else:
            block_ends = num.cumsum()  # flat index of the query block after each row's last
            # Per query block: its row's seat and its block in that row's canvas.
            block_seat = np.repeat(slots, num)
            query_block = np.repeat(first - block_ends + num, num) + self._range(int(block_ends[-1]))
        # Each query block's request's page table, from the seats' mirror (not the requests' lists)
        segments = Segments(seats.pages[block_seat], query_block + 1, num)
        positions = self._block_rows(int(seats.max_blocks))[query_block].ravel()
        rows = RowArrays(slots, first, block_seat * seats.max_blocks + query_block, segments, positions)
        if self.on_step is not None:  # TP: the step channel sends rows, keyed by (seat, serial)
            rows.tp_rows = list(zip(first.tolist(), num.tolist(), batch.decodes.tolist(),
                                    [r.page_table for r in batch.requests]))
            rows.tp_seats = list(zip(slots.tolist(), [r.serial for r in batch.requests]))
        if self.routing_block_size:
            # Block routing pools experts per routing block: each must be one request's, aligned
            # (graph padding is whole scratch blocks after the real tokens, so it never mixes in).
            check_routing_blocks(positions, self.routing_block_size, row_starts=(block_ends - num) * bl)
        if batch.single_blocks and slots.shape[0]:  # every row decodes, its block is its whole input
            seat, block_index = slots, self._range(slots.shape[0] * bl)
            rows.requests = batch.requests
        else:
            decoding_rows = batch.decodes.nonzero()[0]
            if not decoding_rows.shape[0]:
                return rows
            # each decoding row's active block is its last query block
            block_index = self._block_rows(int(block_ends[-1]))[block_ends[decoding_rows] - 1].ravel()
            if decoding_rows.shape[0] == slots.shape[0]:
                seat, rows.requests = slots, batch.requests
            else:
                seat, rows.requests = slots[decoding_rows], [batch.requests[i] for i in decoding_rows.tolist()]
        rows.seat, rows.block_index = seat, block_index
        prompt = np.minimum(np.maximum(seats.num_prompt_tokens[seat] - seats.active_block[seat] * bl, 0), bl)
        # Full logits of the whole block: a sampling row (its generator draws for every position)
        # and a decoder that reads more than (argmax, probability), e.g. levenshtein_joint.
        full = seats.full_logits[seat]
        rows.greedy_if_masked = (self._block_offsets >= prompt[:, None]) & ~full[:, None]
        edits = seats.edits[seat]
        if edits.any():
            rows.greedy_always = rows.greedy_if_masked & edits[:, None]
        rows.full_rows = full.nonzero()[0]
        rows.constrained = seats.constrained[seat].nonzero()[0]
        rows.full_index = block_index.reshape(seat.shape[0], bl)[rows.full_rows].ravel()
        rows.decoders = sorted(seats.decoder_names[i] for i in set(seats.decoder_id[seat].tolist()))
        rows.owners = owners = np.empty((seat.shape[0], 2), dtype=np.int64)  # (3x faster than np.stack)
        owners[:, 0], owners[:, 1] = seats.serial[seat], seats.active_block[seat]
        return rows

    # --- the forward ---
    def run(self, batch: ScheduledBatch) -> Optional[StepOutput]:
        """One forward over every row and the decode step of its decoding rows."""
        return self.finish(batch, self.launch(batch))[0]

    def launch(self, batch: ScheduledBatch, tokens: Optional[np.ndarray] = None) -> Launched:
        """Start the batch's forward; `tokens`: its rows' active blocks [R, bl] when the seats do not
        hold them yet (a forward launched ahead of postprocess, `finish`)."""
        with torch.inference_mode():  # entered once a half step: each entry costs the host µs
            inputs = self.prepare_forward(batch, tokens)
            if self.on_step is not None:  # TP / DP: every rank is sent the whole step, logit rows too
                decode_inputs = self.prepare_decode(batch, inputs)
                self.on_step(inputs)
                greedy, logits, ids, extra_dev = self.execute(inputs, self._decode_arrays(decode_inputs))
                self._retired = None
                return Launched(inputs, None, ids, decode_inputs, (greedy, logits, extra_dev))
            hidden, ids, _ = self._forward(inputs, [])
            self._retired = None  # (while the forward runs)
            return Launched(inputs, hidden, ids)

    def finish(self, batch: ScheduledBatch, launched: Launched, then: Optional[ScheduledBatch] = None
               ) -> tuple[Optional[StepOutput], Optional[Launched]]:
        """(the decode step of the launched forward's decoding rows, the next forward or None).
        `then`: the scheduler's next batch if no row of this one finishes its block now (the same
        rows on the same blocks, Scheduler.following); launched right after the results show that
        none did, with the new blocks as its tokens, so the GPU does not wait for postprocess."""
        with torch.inference_mode():
            if launched.head is not None:  # TP / DP: decoded rows and head prepared before the launch
                if launched.decode_inputs is None:
                    return None, None
                greedy, logits, extra_dev = launched.head
                return self._decode(launched.decode_inputs, greedy, logits, launched.ids, *extra_dev)
            inputs = launched.inputs
            # While the forward runs: the decoding rows, the logit rows, and their upload.
            decode_inputs = self.prepare_decode(batch, inputs)
            if decode_inputs is None:
                return None, None
            logit_index, *extra_dev = self.staging.upload([inputs.logit_index, *self._decode_arrays(decode_inputs)])
            greedy, logits = self._head(launched.hidden, logit_index, inputs.num_greedy)
            return self._decode(decode_inputs, greedy, logits, launched.ids, *extra_dev, then=then)

    @staticmethod
    def _decode_arrays(decode_inputs: Optional[DecodeInputs]) -> list[np.ndarray]:
        """The decode step's host indices, uploaded with the step."""
        if decode_inputs is None:
            return []
        return [decode_inputs.slots, decode_inputs.block_index, decode_inputs.greedy_target,
                decode_inputs.full_rows, decode_inputs.log_len]

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, extra: list[np.ndarray] = ()
                ) -> tuple[Optional[tuple[torch.Tensor, torch.Tensor]], Optional[torch.Tensor], torch.Tensor,
                           list[torch.Tensor]]:
        """((argmax, probability) of the first num_greedy logit rows or None (also on TP workers),
        logits of the other logit rows [P - num_greedy, V] or None, input ids on the device, `extra`
        uploaded)."""
        hidden, ids, (logit_index, *extra_dev) = self._forward(inputs, [inputs.logit_index, *extra])
        greedy, logits = self._head(hidden, logit_index, inputs.num_greedy)
        return greedy, logits, ids, extra_dev

    def _forward(self, inputs: StepInputs, arrays: list[np.ndarray]
                 ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Launch the forward: (hidden states, input ids on the device, `arrays` on the device: with
        the inputs when eager, after the launch when a graph replays)."""
        bl = self.block_length
        segments = inputs.plan_segments()
        token_ids, slots = inputs.token_ids.astype(np.int64, copy=False), segments.slot_mapping(bl)
        self.staging.begin()
        if self.graphs is not None and self.graphs.can_run(segments):
            self.num_graph_forwards += 1
            # the graph reads its inputs from the host (staging.py); the rest is uploaded while it runs
            hidden, ids = self.graphs.run(token_ids, inputs.positions, slots, segments)
            return hidden, ids, self.staging.upload(arrays) if arrays else []
        self.num_eager_forwards += 1
        ids, pos, slots_dev, *uploaded = self.staging.upload([token_ids, inputs.positions, slots, *arrays])
        if self.backend == "sdpa":
            meta = build_metadata(segments, bl, self.device, dense=True)
        else:
            meta = AttentionMetadata(slots_dev, segments)
        self.attention.begin(meta)
        # launched_at: after the attention plan (host work the GPU waits for), before the forward
        self.launched_at = time.perf_counter()
        return self.model(ids, pos, self.attention), ids, uploaded

    def _head(self, hidden: torch.Tensor, logit_index: torch.Tensor, num_greedy: int
              ) -> tuple[Optional[tuple[torch.Tensor, torch.Tensor]], Optional[torch.Tensor]]:
        """The logits head at the logit rows: greedy statistics of the first num_greedy, full logits after."""
        greedy = logits = None
        if num_greedy:
            greedy = self.model.compute_greedy_stats(hidden[logit_index[:num_greedy]], fp32=self.fp32_logits)
        if logit_index.shape[0] > num_greedy:
            logits = self.model.compute_logits(hidden[logit_index[num_greedy:]], fp32=self.fp32_logits)
        return greedy, logits

    # --- the decode step ---
    def _decode(self, inputs: DecodeInputs, greedy: Optional[tuple[torch.Tensor, torch.Tensor]],
                logits: Optional[torch.Tensor], ids: torch.Tensor, slots: torch.Tensor, block_index: torch.Tensor,
                greedy_target: torch.Tensor, full_rows: torch.Tensor, log_len: torch.Tensor,
                then: Optional[ScheduledBatch] = None) -> tuple[StepOutput, Optional[Launched]]:
        bl = self.block_length
        num = len(inputs.requests)
        state_store = self.step_state
        state_store.refresh(inputs.requests, inputs.slots, inputs.owners)
        block = ids[block_index].view(num, bl)  # the active blocks as the forward read them
        tokens = block.clone().view(-1)
        conf = torch.zeros(num * bl, dtype=torch.float32, device=self.device)
        if greedy is not None:
            greedy_tokens, greedy_conf = greedy
            tokens.index_copy_(0, greedy_target, greedy_tokens)
            conf.index_copy_(0, greedy_target, greedy_conf)
        tokens, conf = tokens.view(num, bl), conf.view(num, bl)
        full_logits = logits.view(len(inputs.full_rows), bl, -1) if len(inputs.full_rows) else None
        guard = None
        if inputs.constrained.shape[0]:  # grammar rows (all full-logit rows): the mask before any proposal
            constrained_blocks = block[torch.as_tensor(inputs.constrained, device=block.device)].cpu().numpy()
            guard = BlockGuard(inputs.requests, inputs.constrained, constrained_blocks, self.mask_id)
            guard.mask_logits(full_logits, inputs.full_rows)
        for j, r in enumerate(inputs.full_rows.tolist()):
            request = inputs.requests[r]
            p = request.params
            if p.temperature == 0:
                continue  # a needs_logits decoder's greedy row: it reads full_logits itself
            tokens[r], conf[r] = DECODERS[p.decoder].propose(full_logits[j].float(), p.temperature, p.top_k, p.top_p,
                                                             self._generator(request))
        knobs, decoder_ids, prompt_len, state = state_store.gather(slots)
        editable = torch.arange(bl, device=self.device)[None, :] >= prompt_len[:, None]
        masked = (block == self.mask_id) & editable  # a literal mask token in the prompt is prompt text
        if guard is not None:
            guard.greedy_proposals(tokens, conf, full_logits, inputs.full_rows, masked, editable)
        present = [DECODERS[name] for name in inputs.decoders]
        # a logging decoder reads its rows' history up to the longest log in the batch, plus the row it appends
        history = (state_store.gather_history(slots, int(inputs.log_len.max()) + 1)
                   if any(d.logs for d in present) else None)
        # Columns of the decoders in this batch only: read, updated, stored and shipped to the host.
        columns = sorted({c for d in present for c in d.columns})
        batch = DecodeBatch(tokens, conf, block, masked, editable, knobs, state, self.mask_id,
                            columns=state_store.gather_columns(slots, columns), history=history,
                            history_len=log_len, logits=full_logits, logit_rows=full_rows, special=self.special)
        result = decode(batch, decoder_ids, inputs.decoders)
        if guard is not None:
            apply_repair(guard, result, decoder_ids)
        state_store.store(slots, result.state, result.columns, result.log, result.logged, log_len)
        names = state_store.state_names
        parts = ([result.block, result.filled[:, None], result.edited[:, None], result.final[:, None].long()]
                 + [result.state[n][:, None] for n in names] + [result.columns[c] for c in columns])
        if result.log is not None:
            parts += [result.log, result.logged[:, None].long()]
        batch.logits = full_logits = logits = None  # (the one large tensor: freed now)
        self._retired = (batch, result, parts, greedy, ids, slots, block_index, greedy_target, full_rows, log_len,
                         tokens, conf, decoder_ids, prompt_len, state)
        host = torch.cat(parts, dim=1).cpu().numpy()  # the step's one device->host copy
        self.staging.drained()  # (so the next step need not wait on the staging event: ~20 µs)
        self.results_at = time.perf_counter()
        following = None
        if then is not None and not host[:, bl + 2].any():  # no block is final: the same rows go again
            following = self._launch_following(then, host[:, :bl])
        at = bl + 3 + len(names)
        out = StepOutput(host[:, :bl], host[:, bl], host[:, bl + 1], host[:, bl + 2].astype(bool), host[:, bl + 3:at],
                         {c: host[:, at + i * bl:at + (i + 1) * bl] for i, c in enumerate(columns)})
        if result.log is not None:
            at += len(columns) * bl
            out.log, out.logged = host[:, at:at + bl], host[:, at + bl].astype(bool)
        return out, following

    def settle(self) -> None:
        """Wait until the queued forwards have run: before a launched forward is dropped (its rows
        changed), so no host memory it reads (staged inputs, a backend's plan) is rewritten early."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
            self.staging.drained()

    def _launch_following(self, batch: ScheduledBatch, blocks: np.ndarray) -> Optional[Launched]:
        """launch(batch, blocks), or None where it raised: the engine then schedules and launches
        the next step itself, where a failing row fails alone (this step's results stand)."""
        try:
            return self.launch(batch, blocks)
        except Exception as err:  # noqa: BLE001
            log.warning("launching the next forward ahead failed (%s: %s); it runs after postprocess",
                        type(err).__name__, err)
            return None

    def _generator(self, request: Request) -> torch.Generator:
        if request.generator is None:
            request.generator = torch.Generator(device=self.device)
            request.generator.manual_seed(request.params.seed)
        return request.generator

    def invalidate_step_state(self) -> None:
        """After a failed step: rewrite every seat from the host mirror before its next use."""
        self.step_state.owner[:] = -1
