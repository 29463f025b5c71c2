"""The running batch's host state, one row per seat: what schedule, prepare and postprocess read and
write with a few numpy calls per step instead of a Python loop over rows (vLLM v1's persistent
input batch; its device twin is step_state.StepState, same seats).

A request holds a seat from admission to release. While seated, its canvas tokens, progress
counters (active block, cached blocks, forwards in the block, last scheduled step) and decoder
state live here and the Request's attributes read through to them (sequence.py); on release they
are copied back into the request, so a preempted request resumes with the same values.

Only the scheduler writes these arrays (its postprocess, and admission / preemption in schedule);
tests/test_step_pipeline.py checks that a step's forward leaves them untouched. The page tables'
mirror (`pages`) belongs to the block manager, which writes it as it hands out pages; the runner
reads it to build slot mappings and the attention plan (layers/segments.py).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from fluxlab.engine.decoding.registry import DECODERS
from fluxlab.engine.sequence import SEATED, Request

# Per-seat int64 counters a Request reads through while seated (sequence.py's properties).
PROGRESS = SEATED
# Per-seat work done since the request took the seat, folded into request.stats when it leaves
# (not at each block commit: three fewer numpy calls and a loop over committing rows).
UNFOLDED = ("forwards", "tokens_accepted", "tokens_edited")
# Seats.counts' columns: a decoding forward adds 1, 1, its accepted and its edited tokens.
COUNTED = ("forwards", "forwards_in_block", "tokens_accepted", "tokens_edited")


class Seats:
    def __init__(self, num_seats: int, max_blocks: int, block_length: int, pages: np.ndarray):
        self.block_length = block_length
        self.max_blocks = max_blocks
        self.state_names = sorted({s for d in DECODERS.values() for s in d.state})
        self.column_names = sorted({c for d in DECODERS.values() for c in d.columns})
        self.decoder_names = list(DECODERS)
        self.requests: list[Optional[Request]] = [None] * num_seats
        self.serial = np.full(num_seats, -1, dtype=np.int64)  # the seated request's serial
        self.tokens = np.zeros((num_seats, max_blocks * block_length), dtype=np.int64)  # the canvas
        # The same memory by block: [seat, block] indexes whole blocks (4x faster than [seat, positions])
        self.blocks = self.tokens.reshape(num_seats, max_blocks, block_length)
        # and as one row per (seat, block): a 1-d `take` of seat * max_blocks + block gathers fastest
        self.block_rows = self.tokens.reshape(num_seats * max_blocks, block_length)
        # What each decoding forward adds to, one row per seat (postprocess: one read-modify-write);
        # the named counters are its columns.
        self.counts = np.zeros((num_seats, len(COUNTED)), dtype=np.int64)
        for j, name in enumerate(COUNTED):
            setattr(self, name, self.counts[:, j])
        for name in set(PROGRESS + UNFOLDED) - set(COUNTED):
            setattr(self, name, np.zeros(num_seats, dtype=np.int64))
        self.decoding = np.zeros(num_seats, dtype=bool)  # state is DECODING (its last row decoded)
        self.state = np.zeros((num_seats, len(self.state_names)), dtype=np.int64)
        self.columns = np.zeros((num_seats, len(self.column_names), block_length), dtype=np.int64)
        self.log_len = np.zeros(num_seats, dtype=np.int64)  # rows in the request's decoder_log
        # Per-request constants, written at admission:
        self.num_prompt_tokens = np.zeros(num_seats, dtype=np.int64)
        self.decoder_id = np.zeros(num_seats, dtype=np.int64)  # index in DECODERS
        self.edits = np.zeros(num_seats, dtype=bool)  # the decoder rewrites non-mask positions
        self.full_logits = np.zeros(num_seats, dtype=bool)  # sampled, a needs_logits decoder, or constrained
        self.constrained = np.zeros(num_seats, dtype=bool)  # holds a grammar constraint (engine/constraint)
        self.pages = pages  # [seats, max_blocks] the block manager's mirror of each seat's page table

    # --- a request takes and leaves a seat ---
    def attach(self, request: Request, seat: int) -> None:
        """Seat a request: its canvas, counters and decoder state move here."""
        if request.num_blocks > self.max_blocks:
            raise ValueError(f"a request of {request.num_blocks} blocks does not fit a seat of {self.max_blocks}")
        values = {name: getattr(request, name) for name in PROGRESS}
        state, columns = request.decoder_state, request.decoder_columns
        tokens = request.tokens
        self.tokens[seat, :tokens.shape[0]] = tokens
        for name, value in values.items():
            getattr(self, name)[seat] = value
        for name in UNFOLDED:
            getattr(self, name)[seat] = 0
        self.decoding[seat] = False
        self.state[seat] = [state.get(n, 0) for n in self.state_names]
        self.columns[seat] = 0
        for j, name in enumerate(self.column_names):
            if name in columns:
                self.columns[seat, j] = columns[name]
        self.log_len[seat] = len(request.decoder_log)
        decoder = DECODERS[request.params.decoder]
        self.num_prompt_tokens[seat] = request.num_prompt_tokens
        self.decoder_id[seat] = self.decoder_names.index(decoder.name)
        self.edits[seat] = decoder.edits
        self.constrained[seat] = request.constraint is not None
        self.full_logits[seat] = request.params.temperature > 0 or decoder.needs_logits or self.constrained[seat]
        self.requests[seat] = request
        self.serial[seat] = request.serial
        request.seat_in(self, seat)

    def detach(self, request: Request) -> None:
        """The request leaves its seat (finished, aborted, failed, preempted): its values go back to it."""
        seat = request.slot
        self.fold(seat)
        request.seat_out()
        self.requests[seat] = None

    def fold(self, seat: int) -> None:
        """Add the seat's unfolded work to its request's stats."""
        stats = self.requests[seat].stats
        stats.forwards += int(self.forwards[seat])
        stats.tokens_accepted += int(self.tokens_accepted[seat])
        stats.tokens_edited += int(self.tokens_edited[seat])
        for name in UNFOLDED:
            getattr(self, name)[seat] = 0

    # --- read-through views (sequence.py) ---
    def decoder_state(self, seat: int) -> dict[str, int]:
        return {n: int(v) for n, v in zip(self.state_names, self.state[seat])}

    def decoder_columns(self, seat: int) -> dict[str, np.ndarray]:
        return {n: self.columns[seat, j].copy() for j, n in enumerate(self.column_names)}

    def set_decoder_state(self, seat: int, state: dict[str, int], columns: dict[str, np.ndarray]) -> None:
        self.state[seat] = [state.get(n, 0) for n in self.state_names]
        self.columns[seat] = 0
        for j, name in enumerate(self.column_names):
            if name in columns:
                self.columns[seat, j] = columns[name]
