"""The records between the scheduler and the runner: a forward's rows (`ScheduledBatch`, `ScheduledRow`),
going out, and what the forward decided for its decoding rows (`StepOutput`), coming back to
`Scheduler.postprocess`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from fluxlab.engine.seats import Seats
from fluxlab.engine.sequence import Request


@dataclass
class StepOutput:
    """What one forward decided for its decoding rows (batch.decode_rows order), on the host."""

    blocks: np.ndarray  # [R, bl] the active blocks after the step
    filled: np.ndarray  # [R] mask -> token transfers
    edited: np.ndarray  # [R] token -> token edits
    final: np.ndarray  # [R] bool: the block is final
    # [R, names] decoder state after the step, every registered name in sorted order (Seats.state_names);
    # None: a runner whose decoders keep no registry state (the canvas runner), zeros
    state: Optional[np.ndarray] = None
    columns: dict[str, np.ndarray] = field(default_factory=dict)  # [R, bl] each (decoders present only)
    log: Optional[np.ndarray] = None  # [R, bl] rows appended to each row's decoder log where `logged`
    logged: Optional[np.ndarray] = None  # [R] bool


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
    """One forward's rows as seat-indexed arrays, in batch order (the runner reads the seats' host
    state through `seats`); `rows` gives the same rows as objects, for code off the hot path."""

    requests: list[Request]
    slots: np.ndarray  # [N] seat of each row
    first_block: np.ndarray  # [N] == the request's num_cached_blocks
    num_blocks: np.ndarray  # [N] query blocks in this forward
    decodes: np.ndarray  # [N] bool: the last query block is the active block
    block_length: int
    seats: Optional[Seats] = None
    single_blocks: bool = False  # every row decodes its active block alone (no commit or prefill blocks)
    # The previous batch's rows again, on the same blocks and pages (only their tokens changed): the
    # runner may reuse what it derived from the rows alone (a schedule that reused its rows says so).
    same_rows: bool = False

    @classmethod
    def of_rows(cls, rows: list[ScheduledRow], block_length: int, seats: Optional[Seats] = None) -> "ScheduledBatch":
        # an unseated request (a probe or a bench building rows by hand) has seat -1
        slots = [-1 if r.request.slot is None else r.request.slot for r in rows]
        return cls([r.request for r in rows], np.array(slots, dtype=np.int64),
                   np.array([r.first_block for r in rows], dtype=np.int64),
                   np.array([r.num_blocks for r in rows], dtype=np.int64),
                   np.array([r.decodes for r in rows], dtype=bool), block_length, seats)

    def repeated(self, same_rows: bool) -> "ScheduledBatch":
        """These rows as the next forward's batch, each its active block alone (a batch of single blocks)."""
        return ScheduledBatch(self.requests, self.slots, self.first_block, self.num_blocks, self.decodes,
                              self.block_length, self.seats, single_blocks=True, same_rows=same_rows)

    def select(self, index: list[int]) -> "ScheduledBatch":
        """The batch of only these rows (a failed step retries each row alone)."""
        return ScheduledBatch([self.requests[i] for i in index], self.slots[index], self.first_block[index],
                              self.num_blocks[index], self.decodes[index], self.block_length, self.seats,
                              self.single_blocks)

    @property
    def rows(self) -> list[ScheduledRow]:
        return [ScheduledRow(r, f, n, d) for r, f, n, d in zip(self.requests, self.first_block.tolist(),
                                                                self.num_blocks.tolist(), self.decodes.tolist())]

    @property
    def num_tokens(self) -> int:
        return int(self.num_blocks.sum()) * self.block_length

    @property
    def decode_rows(self) -> list[ScheduledRow]:
        return [r for r in self.rows if r.decodes]

    @property
    def decode_requests(self) -> list[Request]:
        return [self.requests[i] for i in np.flatnonzero(self.decodes)]
