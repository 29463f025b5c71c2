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
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from fluxlab.engine.block_manager import BlockManager
from fluxlab.engine.request import RequestState
from fluxlab.engine.sequence import Request


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
                 block_manager: BlockManager):
        self.policy = policy
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

    def remove(self, request: Request) -> None:
        """Drop a finished or aborted request and free its pages."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)

    # --- scheduling ---
    @staticmethod
    def _in_block(request: Request) -> bool:
        """Inside a block: the active block has had a forward and is not final yet."""
        return request.num_cached_blocks == request.active_block and (
            request.step_in_block > 0 or request.post_steps > 0)

    def schedule(self) -> ScheduledBatch:
        self.num_steps += 1
        total_blocks = self.max_scheduled_tokens // self.block_length
        candidates = list(self.running)
        barrier = True
        if self.policy in ("paged", "static"):
            inside = [r for r in candidates if self._in_block(r)]
            if inside:
                candidates, barrier = inside, False
        candidates.sort(key=lambda r: r.last_scheduled_step)  # stable: arrival order among equals
        rows: list[ScheduledRow] = []
        for request in candidates:
            if request not in self.running:  # preempted while placing an earlier row
                continue
            row = self._place(request, total_blocks - sum(r.num_blocks for r in rows), rows)
            if row is not None:
                rows.append(row)
        budget_blocks = total_blocks - sum(r.num_blocks for r in rows)
        admit = barrier and (self.policy != "static" or not self.running)
        while admit and self.waiting and len(self.running) < self.max_num_seqs and budget_blocks > 0:
            request = self.waiting[0]
            row = self._row_for(request, budget_blocks)
            if not self.block_manager.can_allocate(request, row.first_block + row.num_blocks):
                break  # FIFO: no overtaking; pages come back as running requests finish
            self.waiting.popleft()
            self.block_manager.allocate(request, row.first_block + row.num_blocks)
            request.state = RequestState.PREFILLING
            self.running.append(request)
            rows.append(row)
            budget_blocks -= row.num_blocks
        for row in rows:
            row.request.last_scheduled_step = self.num_steps
        return ScheduledBatch(rows, self.block_length)

    def _row_for(self, request: Request, budget_blocks: int) -> ScheduledRow:
        uncached = request.active_block - request.num_cached_blocks
        if uncached + 1 <= budget_blocks:
            return ScheduledRow(request, request.num_cached_blocks, uncached + 1, decodes=True)
        return ScheduledRow(request, request.num_cached_blocks, min(uncached, budget_blocks), decodes=False)

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
        self.running.remove(victim)
        self.block_manager.free(victim)
        victim.reset_for_preemption()
        # Back at the head of the queue: it is older than anything that arrived after it.
        index = 0
        while index < len(self.waiting) and self.waiting[index].stats.arrival_time < victim.stats.arrival_time:
            index += 1
        self.waiting.insert(index, victim)
