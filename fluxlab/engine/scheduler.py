"""Who runs in the next forward, and with which blocks.

Every row of a forward is one request's run of blocks starting at its first uncached block: final
blocks whose K/V gets written (prompt prefill, or the block that just finished: its commit fused
with the next block's first step) followed, when it fits, by the active block whose logits are
decoded. Policies differ only in when a row may start a new block:
- dynamic: any time (first-done-first-out); prefill chunks and active blocks share each forward.
- paged: step-synchronous; while any running row is inside a block only those rows step, and
  requests join, leave and start blocks together at the barrier.
- static: paged, and new requests are admitted only when the batch is empty (a cohort).
Rows that did not fit the token budget go first next time, so no request starves.

`postprocess` is the one place where a step's results change requests (tokens, counters, blocks,
state); admission and preemption in `schedule` and `abort`/`fail` are the scheduler's other writes.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Protocol

import numpy as np

from fluxlab.engine.block_manager import BlockManager
from fluxlab.engine.request import RequestOutput, RequestState
from fluxlab.engine.sequence import Request


@dataclass
class StepOutput:
    """What one forward decided for its decoding rows (batch.decode_rows order), on the host."""

    blocks: np.ndarray  # [R, bl] the active blocks after the step
    filled: np.ndarray  # [R] mask -> token transfers
    edited: np.ndarray  # [R] token -> token edits
    final: np.ndarray  # [R] bool: the block is final
    state: dict[str, np.ndarray]  # decoder state after the step, [R] each
    columns: dict[str, np.ndarray] = field(default_factory=dict)  # [R, bl] each (decoders present only)
    log: Optional[np.ndarray] = None  # [R, bl] rows appended to each row's decoder log where `logged`
    logged: Optional[np.ndarray] = None  # [R] bool


class TextStops(Protocol):
    """Stop strings and final text (the engine's detokenizer): cuts `request.output_ids` at the first
    stop string in the newly committed text and says whether it hit one."""

    def apply(self, request: Request) -> bool: ...

    def final_text(self, request: Request) -> str: ...


@dataclass
class ScheduledRow:
    request: Request
    first_block: int  # == request.num_cached_blocks
    num_blocks: int  # query blocks in this forward
    decodes: bool  # the last query block is the active block: its logits are decoded

    @property
    def num_commit_blocks(self) -> int:
        return self.num_blocks - 1 if self.decodes else self.num_blocks


@dataclass
class ScheduledBatch:
    rows: list[ScheduledRow]
    block_length: int

    @property
    def num_tokens(self) -> int:
        return sum(r.num_blocks for r in self.rows) * self.block_length

    @property
    def decode_rows(self) -> list[ScheduledRow]:
        return [r for r in self.rows if r.decodes]


class Scheduler:
    def __init__(self, policy: str, max_num_seqs: int, max_scheduled_tokens: int, block_length: int,
                 block_manager: BlockManager, text_stops: Optional[TextStops] = None):
        self.policy = policy
        self.text_stops = text_stops
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))  # seats of the device step state
        self.max_num_seqs = max_num_seqs
        self.max_scheduled_tokens = max_scheduled_tokens
        self.block_length = block_length
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted, in arrival order
        self.num_steps = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)
        if request.slot is not None:
            self.free_slots.append(request.slot)
            request.slot = None

    def abort(self, request: Request) -> RequestOutput:
        self._release(request)
        request.state = RequestState.ABORTED
        request.finish_reason = "abort"
        request.stats.finish_time = time.perf_counter()
        return self._output(request)

    def fail(self, request: Request, error: str) -> RequestOutput:
        """A step raised for this request alone: it ends with finish_reason "error", nobody else does."""
        self._release(request)
        request.state = RequestState.FINISHED
        request.finish_reason = "error"
        request.error = error
        request.stats.finish_time = time.perf_counter()
        return self._output(request)

    # --- a step's results ---
    def postprocess(self, batch: "ScheduledBatch", out: Optional[StepOutput]) -> list[RequestOutput]:
        """Apply one forward to its requests: cached blocks, each decoding row's block, counters,
        block commits, EOS / length / stop-string finishes. Returns the outputs to report."""
        now = time.perf_counter()
        for row in batch.rows:
            request = row.request
            request.num_cached_blocks = row.first_block + row.num_commit_blocks
            request.state = RequestState.DECODING if row.decodes else RequestState.PREFILLING
            # Their K/V is written now, from their final tokens: other requests may share it.
            self.block_manager.cache_blocks(request, row.first_block, request.num_cached_blocks)
        outputs = []
        # Host lists once per step: numpy scalar indexing per row costs more than the row's work.
        filled, edited, final = out.filled.tolist(), out.edited.tolist(), out.final.tolist()
        states = {name: values.tolist() for name, values in out.state.items()}
        logged = out.logged.tolist() if out.logged is not None else None
        for i, row in enumerate(batch.decode_rows):
            request = row.request
            start, end = request.block_range(request.active_block)
            request.tokens[start:end] = out.blocks[i]
            request.stats.forwards += 1
            request.stats.tokens_accepted += filled[i]
            request.stats.tokens_edited += edited[i]
            request.forwards_in_block += 1
            request.decoder_state = {name: values[i] for name, values in states.items()}
            if out.columns:
                request.decoder_columns = {name: values[i].copy() for name, values in out.columns.items()}
            if logged is not None and logged[i]:
                request.decoder_log.append(out.log[i].copy())
            if not final[i]:
                continue
            request.commit_active_block()
            if request.params.stop and request.finish_reason in (None, "length") and self.text_stops is not None:
                if self.text_stops.apply(request):
                    request.finish_reason = "stop"
            if request.stats.first_token_time is None:
                request.stats.first_token_time = now
            if request.finish_reason is not None:
                self._release(request)
                request.state = RequestState.FINISHED
                request.stats.finish_time = now
                outputs.append(self._output(request))
            elif len(request.output_ids) > request.num_emitted:
                outputs.append(self._output(request))
        return outputs

    def _output(self, request: Request) -> RequestOutput:
        finished = request.is_finished
        new = request.output_ids[request.num_emitted:]
        request.num_emitted = len(request.output_ids)
        if finished and request.text is None and self.text_stops is not None and request.finish_reason != "abort":
            request.text = self.text_stops.final_text(request)
        return RequestOutput(request.request_id, new, list(request.output_ids), finished,
                             request.finish_reason if finished else None, request.stats,
                             request.text if finished else None, request.error)

    # --- scheduling ---
    def schedule(self) -> ScheduledBatch:
        self.num_steps += 1
        total_blocks = self.max_scheduled_tokens // self.block_length
        candidates = list(self.running)
        barrier = True
        if self.policy in ("paged", "static"):
            inside = [r for r in candidates if r.in_block]
            if inside:
                candidates, barrier = inside, False
        candidates.sort(key=lambda r: r.last_scheduled_step)  # stable: arrival order among equals
        rows: list[ScheduledRow] = []
        used = 0
        for request in candidates:
            if request.state is RequestState.WAITING:  # preempted while placing an earlier row
                continue
            placed = len(rows)
            row = self._place(request, total_blocks - used, rows)
            if len(rows) != placed:  # a preemption dropped rows
                used = sum(r.num_blocks for r in rows)
            if row is not None:
                rows.append(row)
                used += row.num_blocks
        budget_blocks = total_blocks - used
        admit = barrier and (self.policy != "static" or not self.running)
        while admit and self.waiting and len(self.running) < self.max_num_seqs and budget_blocks > 0:
            request = self.waiting[0]
            hits = self.block_manager.match(request)  # leading final blocks whose K/V is cached
            row = self._row_for(request, budget_blocks, first_block=len(hits))
            if not self.block_manager.can_allocate(request, row.first_block + row.num_blocks, hits):
                break  # FIFO: no overtaking; pages come back as running requests finish
            self.waiting.popleft()
            self.block_manager.allocate(request, row.first_block + row.num_blocks, hits)
            request.num_cached_blocks = len(hits)
            if not request.stats.preemptions:  # OpenAI's cached_tokens: prompt tokens served from the cache
                request.stats.cached_tokens = len(hits) * self.block_length
            request.slot = self.free_slots.pop()
            request.state = RequestState.PREFILLING
            self.running.append(request)
            rows.append(row)
            budget_blocks -= row.num_blocks
        for row in rows:
            row.request.last_scheduled_step = self.num_steps
        return ScheduledBatch(rows, self.block_length)

    def _row_for(self, request: Request, budget_blocks: int, first_block: Optional[int] = None) -> ScheduledRow:
        first = request.num_cached_blocks if first_block is None else first_block
        uncached = request.active_block - first
        if uncached + 1 <= budget_blocks:
            return ScheduledRow(request, first, uncached + 1, decodes=True)
        return ScheduledRow(request, first, min(uncached, budget_blocks), decodes=False)

    def _place(self, request: Request, budget_blocks: int, rows: list[ScheduledRow]) -> ScheduledRow | None:
        """A row for a running request, preempting the newest running requests if pages run out."""
        if budget_blocks <= 0:
            return None
        row = self._row_for(request, budget_blocks)
        needed = row.first_block + row.num_blocks
        while not self.block_manager.can_allocate(request, needed):
            victim = self.running[-1]
            self._preempt(victim, rows)
            if victim is request:
                return None
        self.block_manager.allocate(request, needed)
        return row

    def _preempt(self, victim: Request, rows: list[ScheduledRow]) -> None:
        rows[:] = [r for r in rows if r.request is not victim]
        self._release(victim)
        victim.reset_for_preemption()
        # Back at the head of the queue: it is older than anything that arrived after it.
        index = 0
        while index < len(self.waiting) and self.waiting[index].stats.arrival_time < victim.stats.arrival_time:
            index += 1
        self.waiting.insert(index, victim)
