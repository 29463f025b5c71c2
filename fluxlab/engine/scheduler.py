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

import logging
import math
import time
from collections import deque
from typing import Any, Optional, Protocol

import numpy as np

from fluxlab.engine.batch import ScheduledBatch, ScheduledRow, StepOutput
from fluxlab.engine.block_manager import BlockManager
from fluxlab.engine.request import RequestOutput, RequestState
from fluxlab.engine.seats import COUNTED, Seats
from fluxlab.engine.sequence import Request

log = logging.getLogger("fluxlab.engine")


class TextStops(Protocol):
    """Stop strings and final text (the engine's detokenizer): cuts `request.output_ids` at the first
    stop string in the newly committed text and says whether it hit one."""

    tokenizer: Any

    def apply(self, request: Request) -> bool: ...

    def final_text(self, request: Request) -> str: ...


class Scheduler:
    def __init__(self, policy: str, max_num_seqs: int, max_scheduled_tokens: int, block_length: int,
                 block_manager: BlockManager, text_stops: Optional[TextStops] = None, decode_writes_kv: bool = True,
                 request_timeout_s: float = 0.0):
        """decode_writes_kv: a decoding forward writes its active block's K/V as a commit would (LLaDA2:
        the block attends to the prefix and itself either way); Diffusion-Gemma's denoising pass writes none.
        request_timeout_s: seconds a request may hold a seat from its first admission (<= 0: no limit)."""
        self.policy = policy
        self.request_timeout_s = request_timeout_s
        self._next_deadline = math.inf  # no running request's deadline is earlier (stale-early is fine)
        self.decode_writes_kv = decode_writes_kv
        self.text_stops = text_stops
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))  # seats of the host and device step state
        self.max_num_seqs = max_num_seqs
        self.max_scheduled_tokens = max_scheduled_tokens
        self.block_length = block_length
        self.block_manager = block_manager
        self.seats = Seats(max_num_seqs, block_manager.seat_pages.shape[1], block_length, block_manager.seat_pages)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted, in arrival order
        self._running_slots: list[int] = []  # their seats, same order
        self._slots_array: Optional[np.ndarray] = None  # _running_slots as an array, until running changes
        # The last batch, when the next schedule would give the same rows (see postprocess);
        # _repeat_same: it is the last batch itself (same blocks too), not its rows' active blocks.
        self._repeat: Optional[ScheduledBatch] = None
        self._repeat_same = False
        self._added = np.ones((0, len(COUNTED)), dtype=np.int64)  # what postprocess adds to seats.counts, per row
        self.num_steps = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, request: Request) -> None:
        self._repeat = None
        if request in self.running:
            index = self.running.index(request)
            del self.running[index], self._running_slots[index]
            self._slots_array = None
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)
        if request.slot is not None:
            self.free_slots.append(request.slot)
            self.seats.detach(request)

    def abort(self, request: Request) -> RequestOutput:
        return self._end(request, RequestState.ABORTED, "abort")

    def fail(self, request: Request, error: str) -> RequestOutput:
        """A step raised for this request alone: it ends with finish_reason "error", nobody else does."""
        request.error = error
        return self._end(request, RequestState.FINISHED, "error")

    def _end(self, request: Request, state: RequestState, finish_reason: str) -> RequestOutput:
        """A request leaves before its decoding finished it: seat and pages freed, its output final."""
        self._release(request)
        request.state = state
        request.finish_reason = finish_reason
        request.stats.finish_time = time.perf_counter()
        return self._output(request)

    def end_overdue(self) -> list[RequestOutput]:
        """Running requests past their deadline end with the tokens they have (finish_reason "length")
        and free their seat and pages, so no request holds a seat longer than request_timeout_s,
        whatever its knobs (issue 35). One comparison a step until some deadline may have passed."""
        now = time.perf_counter()
        if now < self._next_deadline:
            return []
        timeout = self.request_timeout_s
        overdue = [r for r in self.running if r.stats.admitted_time + timeout <= now]
        outputs = [self._end_overdue(r, now) for r in overdue]
        self._next_deadline = min((r.stats.admitted_time + timeout for r in self.running), default=math.inf)
        return outputs

    def _end_overdue(self, request: Request, now: float) -> RequestOutput:
        log.warning("request %s held its seat %.1f s, past server.request_timeout_s=%g: it ends with its %d "
                    "committed tokens (finish_reason length)", request.request_id, now - request.stats.admitted_time,
                    self.request_timeout_s, len(request.output_ids))
        request.stats.timed_out = True
        return self._end(request, RequestState.FINISHED, "length")

    def _start_clock(self, request: Request) -> None:
        """Admission: the request's deadline counts from its first seat (a preempted one keeps it)."""
        stats = request.stats
        if stats.admitted_time is None:
            stats.admitted_time = time.perf_counter()
        self._next_deadline = min(self._next_deadline, stats.admitted_time + self.request_timeout_s)

    # --- a step's results ---
    def postprocess(self, batch: ScheduledBatch, out: Optional[StepOutput]) -> list[RequestOutput]:
        """Apply one forward to its requests: cached blocks, each decoding row's block, counters,
        block commits, EOS / length / stop-string finishes. Returns the outputs to report."""
        now = time.perf_counter()
        self._repeat = None
        seats, bl = self.seats, self.block_length
        slots, first, decodes = batch.slots, batch.first_block, batch.decodes
        if not batch.single_blocks:  # rows with final blocks whose K/V this forward wrote
            commits = batch.num_blocks - decodes
            seats.num_cached_blocks[slots] = first + commits
            if self.block_manager.enable_prefix_cache:
                # Their K/V is written now, from their final tokens: other requests may share it.
                committing = commits.nonzero()[0]
                at = first[committing]
                self.block_manager.cache_rows([batch.requests[i] for i in committing.tolist()], at.tolist(),
                                              (at + commits[committing]).tolist(),
                                              seats.block_rows.take(slots[committing] * seats.max_blocks + at, axis=0))
        changed = []  # the last batch's rows again: every one decoded then and decodes now
        if not batch.same_rows:
            changed = (seats.decoding[slots] != decodes).nonzero()[0].tolist()
            for i in changed:
                batch.requests[i].state = RequestState.DECODING if decodes[i] else RequestState.PREFILLING
            seats.decoding[slots] = decodes
        if out is None:
            return []
        if batch.single_blocks:  # every row decodes its active block, the row's first block
            rows, seat, active = None, slots, first
        else:
            rows = decodes.nonzero()[0]
            seat = slots if rows.shape[0] == slots.shape[0] else slots[rows]
            active = seats.active_block[seat]
        final = out.final.nonzero()[0]
        if final.shape[0]:
            # A block whose final forward changed none of its tokens got its K/V from that forward,
            # computed over its final tokens: it needs no commit segment in the next forward.
            written = seats.blocks[seat[final], active[final]]
            kv_written = ((written == out.blocks[final]).all(axis=1) & self.decode_writes_kv).tolist()
        seats.blocks[seat, active] = out.blocks
        if self._added.shape[0] < seat.shape[0]:
            self._added = np.ones((2 * seat.shape[0], len(COUNTED)), dtype=np.int64)
        added = self._added[:seat.shape[0]]  # columns 0 and 1 stay 1: forwards, forwards in the block
        added[:, 2], added[:, 3] = out.filled, out.edited
        counted = seats.counts.take(seat, axis=0)  # (take, add, write back: 1.5x faster than fancy +=)
        counted += added
        seats.counts[seat] = counted
        seats.state[seat] = 0 if out.state is None else out.state
        for name, values in out.columns.items():
            seats.columns[seat, seats.column_names.index(name)] = values
        requests = batch.requests
        if out.logged is not None:
            for i in out.logged.nonzero()[0].tolist():
                requests[i if rows is None else rows[i]].decoder_log.append(out.log[i].copy())
                seats.log_len[seat[i]] += 1
        outputs = []
        if not final.shape[0]:
            # Nothing finished a block, so every row is still inside its block. When every running
            # request was in this batch (its rows are distinct running requests), each was scheduled
            # now, so the next schedule gives them in `running` order, each its active block alone
            # (a commit + decode row's commit is cached now), and no row needs a new page or lets a
            # waiting request in (paged: not at a barrier).
            if not changed and len(batch.requests) == len(self.running):
                if self._repeats_itself(batch, changed=False):
                    self._repeat, self._repeat_same = batch, True
                elif decodes.all():  # after a commit step, or rows that met at a barrier in another order
                    running = self._running_slot_array()
                    ones = np.ones(running.shape[0], dtype=np.int64)
                    self._repeat = ScheduledBatch(list(self.running), running, seats.active_block[running], ones,
                                                  ones.astype(bool), bl, seats, single_blocks=True)
                    self._repeat_same = False
            return outputs
        # The seats move on to their next block (counters, decoder state zero at block entry) ...
        seat, committed = seat[final], active[final]
        seats.active_block[seat] = committed + 1
        committed = committed.tolist()
        for array in (seats.forwards_in_block, seats.state, seats.columns, seats.log_len):
            array[seat] = 0
        # ... and each request takes its block's output (per committing row only; its work counters
        # stay in the seat until it leaves: Seats.fold).
        blocks = out.blocks[final].tolist()
        if rows is not None:
            final = rows[final]  # decoding row -> batch row
        for j, i in enumerate(final.tolist()):
            request = requests[i]
            stats = request.stats
            if kv_written[j]:
                request.num_cached_blocks = committed[j] + 1
                self.block_manager.cache_blocks(request, committed[j], committed[j] + 1)
            request.commit_block(committed[j], blocks[j])  # cut at its first EOS / max_new_tokens
            # The stop strings are searched in the text before that cut, so one found lies before
            # EOS and length: the earliest of the three ends the request (an EOS in the block too).
            if request.params.stop and self.text_stops is not None and self.text_stops.apply(request):
                request.finish_reason = "stop"
            if stats.first_token_time is None:
                stats.first_token_time = now
            if request.finish_reason is not None:
                self._release(request)
                request.state = RequestState.FINISHED
                stats.finish_time = now
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

    def following(self, batch: ScheduledBatch) -> Optional[ScheduledBatch]:
        """What the next schedule gives if no row of `batch` finishes its block in this forward:
        `batch` again (postprocess keeps it as the repeat), or None where it would not. The engine
        launches it as soon as the results show that no block finished (async scheduling)."""
        # (postprocess computes `changed` the same way, before it writes seats.decoding)
        changed = not batch.same_rows and not self.seats.decoding[batch.slots].all()
        return batch.repeated(same_rows=True) if self._repeats_itself(batch, changed) else None

    def _repeats_itself(self, batch: ScheduledBatch, changed: bool) -> bool:
        """Whether, when none of its blocks finishes, the next schedule gives `batch` itself again (same
        rows, same blocks, same order): it held every running request, each on its active block alone,
        and no row's decoding state changed (`changed`)."""
        return (not changed and batch.single_blocks and len(batch.requests) == len(self.running)
                and batch.requests == self.running)

    # --- scheduling ---
    def schedule(self, rows_in_flight: bool = False) -> ScheduledBatch:
        """rows_in_flight: the next forward of the last batch's rows is running already (launched
        ahead, `following`): a dynamic scheduler repeats them and admits waiting requests one step
        later, instead of wasting that forward."""
        self.num_steps += 1
        repeat = self._repeat
        if repeat is not None and (self.policy != "dynamic" or rows_in_flight or not self.waiting
                                   or len(self.running) >= self.max_num_seqs):
            self.seats.last_scheduled_step[repeat.slots] = self.num_steps
            return repeat.repeated(same_rows=self._repeat_same)
        total_blocks = self.max_scheduled_tokens // self.block_length
        running = self._place_running(total_blocks)
        if running is None:
            running = self._place_running_one_by_one(total_blocks)
        requests, slots, first, num, decodes, barrier, single = running
        budget_blocks = total_blocks - int(num.sum())
        admitted: list[ScheduledRow] = []
        admit = barrier and (self.policy != "static" or not self.running)
        while admit and self.waiting and len(self.running) < self.max_num_seqs and budget_blocks > 0:
            request = self.waiting[0]
            hits = self.block_manager.match(request)  # leading final blocks whose K/V is cached
            row = self._row_for(request, budget_blocks, first_block=len(hits))
            if not self.block_manager.can_allocate(request, row.first_block + row.num_blocks, hits):
                break  # FIFO: no overtaking; pages come back as running requests finish
            self.waiting.popleft()
            self.seats.attach(request, self.free_slots.pop())  # before allocate: the seat mirrors its pages
            self.block_manager.allocate(request, row.first_block + row.num_blocks, hits)
            request.num_cached_blocks = len(hits)
            if not request.stats.preemptions:  # OpenAI's cached_tokens: prompt tokens served from the cache
                request.stats.cached_tokens = len(hits) * self.block_length
            request.state = RequestState.PREFILLING
            if self.request_timeout_s > 0:
                self._start_clock(request)
            self.running.append(request)
            self._running_slots.append(request.slot)
            self._slots_array = None
            self._repeat = None
            admitted.append(row)
            budget_blocks -= row.num_blocks
        if admitted:
            single = False
            extra = ScheduledBatch.of_rows(admitted, self.block_length)
            requests = requests + extra.requests
            slots, first = np.concatenate([slots, extra.slots]), np.concatenate([first, extra.first_block])
            num, decodes = np.concatenate([num, extra.num_blocks]), np.concatenate([decodes, extra.decodes])
        self.seats.last_scheduled_step[slots] = self.num_steps
        return ScheduledBatch(requests, slots, first, num, decodes, self.block_length, self.seats, single)

    def _running_slot_array(self) -> np.ndarray:
        if self._slots_array is None:
            self._slots_array = np.array(self._running_slots, dtype=np.int64)
        return self._slots_array

    def _candidates(self) -> tuple[np.ndarray, bool]:
        """Indices into `running` of the rows that may run, oldest-scheduled first (arrival order
        among equals), and whether the batch is at a barrier (new requests may join)."""
        seats = self.seats
        slots = self._running_slot_array()
        last = seats.last_scheduled_step[slots]
        if self.policy in ("paged", "static"):
            inside = ((seats.num_cached_blocks[slots] == seats.active_block[slots])
                      & (seats.forwards_in_block[slots] > 0))
            if inside.any():
                candidates = inside.nonzero()[0]
                return candidates[np.argsort(last[candidates], kind="stable")], False
        return np.argsort(last, kind="stable"), True

    def _place_running(self, total_blocks: int):
        """Rows for the running requests, vectorised: each takes its uncached blocks plus the active
        block in order until the budget ends (the next row gets what is left, without decoding).
        None when their new pages do not fit: then `_place_running_one_by_one` preempts."""
        seats = self.seats
        candidates, barrier = self._candidates()
        slots = self._running_slot_array()[candidates]
        first = seats.num_cached_blocks[slots]
        uncached = seats.active_block[slots] - first
        need = uncached + 1
        taken = need.cumsum()
        fit = int(taken.searchsorted(total_blocks, side="right"))  # rows whose whole need fits
        left = total_blocks - (int(taken[fit - 1]) if fit else 0)
        num, decodes = need[:fit], np.ones(fit, dtype=bool)
        single = fit == slots.shape[0] and (not fit or int(taken[-1]) == fit)  # every need is 1
        if fit < slots.shape[0]:
            if left > 0:  # a chunk of its uncached blocks (uncached >= left here)
                fit += 1
                num, decodes = np.append(num, min(int(uncached[fit - 1]), left)), np.append(decodes, False)
            slots, first, candidates = slots[:fit], first[:fit], candidates[:fit]
        manager = self.block_manager
        total_missing = 0  # a dense seat holds its whole slot from admission on
        if manager.layout != "dense":
            missing = np.maximum(first + num - manager.seat_num_pages[slots], 0)
            total_missing = int(missing.sum())
        if total_missing > manager.num_free_pages:
            return None
        requests = [self.running[i] for i in candidates.tolist()]
        if total_missing:  # in row order: the pages the sequential rule gives
            short = missing.nonzero()[0]
            manager.extend([requests[i] for i in short.tolist()], (first + num)[short].tolist())
        return requests, slots, first, num, decodes, barrier, single

    def _place_running_one_by_one(self, total_blocks: int):
        """The same rows, one at a time, preempting the newest running requests while pages run out."""
        candidates, barrier = self._candidates()
        ordered = [self.running[i] for i in candidates.tolist()]
        rows: list[ScheduledRow] = []
        used = 0
        for request in ordered:
            if request.state is RequestState.WAITING:  # preempted while placing an earlier row
                continue
            placed = len(rows)
            row = self._place(request, total_blocks - used, rows)
            if len(rows) != placed:  # a preemption dropped rows
                used = sum(r.num_blocks for r in rows)
            if row is not None:
                rows.append(row)
                used += row.num_blocks
        batch = ScheduledBatch.of_rows(rows, self.block_length)
        return batch.requests, batch.slots, batch.first_block, batch.num_blocks, batch.decodes, barrier, False

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
