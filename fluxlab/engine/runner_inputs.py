"""What the model runner passes between its stages: a forward's host inputs (`StepInputs`), what it derives
from a batch's rows (`RowArrays`), a forward in flight (`Launched`) and rank 0's half of a decode step
(`DecodeInputs`). StepInputs is also what the TP step channel sends to the workers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from fluxlab.engine.layers.segments import Segments
from fluxlab.engine.sequence import Request


@dataclass
class StepInputs:
    """One forward's inputs as host arrays: flattened tokens and positions, the query segments the
    attention backend plans (layers/segments.py), and the flat token indices whose logits are
    needed, the first num_greedy of them greedy positions (argmax + probability only; under TP no
    full logits cross ranks for them). `rows`: (first_block, num_blocks, decodes, page_table) per
    row, what the TP step channel sends (built only under TP; without `segments` they are planned
    from it). `seats`: each row's (request.slot, request.serial), so TP workers keep a seat's page
    table and tokens and are sent only what changed (None: rows of no seat)."""

    token_ids: np.ndarray
    positions: np.ndarray
    rows: Optional[list[tuple[int, int, bool, Sequence[int]]]]
    logit_index: np.ndarray
    num_greedy: int = 0
    seats: Optional[list[tuple[int, int]]] = None  # (seat, request serial) per row: TP workers' state keys
    segments: Optional[Segments] = None  # None: from rows

    def plan_segments(self) -> Segments:
        if self.segments is None:
            self.segments = Segments.of_rows([(first, n, table) for first, n, _, table in self.rows])
        return self.segments

    @property
    def num_segments(self) -> int:
        return self.plan_segments().num_segments


@dataclass
class RowArrays:
    """What prepare derives from a batch's rows alone (not their tokens): reused while the
    scheduler hands the same rows again (ScheduledBatch.same_rows)."""

    slots: np.ndarray  # the batch's own arrays (checked by identity before a reuse)
    first_block: np.ndarray
    block_row: np.ndarray  # [S] each query block's row of seats.block_rows (its seat's, its block)
    segments: Segments
    positions: np.ndarray  # [T]
    tp_rows: Optional[list] = None  # StepInputs.rows and .seats (TP only)
    tp_seats: Optional[list] = None
    # Decoding rows (seat None: none decodes):
    seat: Optional[np.ndarray] = None  # [R]
    block_index: Optional[np.ndarray] = None  # [R * bl] flat token index of each active block
    requests: Optional[list[Request]] = None
    greedy_if_masked: Optional[np.ndarray] = None  # [R, bl] a greedy logit wherever these hold a mask
    greedy_always: Optional[np.ndarray] = None  # [R, bl] greedy logits whatever the token (editing decoders)
    full_rows: Optional[np.ndarray] = None  # [F]
    full_index: Optional[np.ndarray] = None  # [F * bl] their flat token indices
    decoders: Optional[list[str]] = None
    owners: Optional[np.ndarray] = None  # [R, 2] (request serial, active block)
    constrained: Optional[np.ndarray] = None  # [C] decoding rows with a grammar (engine/constraint)


@dataclass
class Launched:
    """A forward in flight (`launch`), what `finish` reads: the hidden states and input ids on the
    device; under TP / DP (prepared before the launch) the decoding rows and the head's results."""

    inputs: StepInputs
    hidden: Optional[torch.Tensor]
    ids: torch.Tensor
    decode_inputs: Optional["DecodeInputs"] = None
    head: Optional[tuple] = None  # (greedy, logits, the decode arrays on the device)


@dataclass
class DecodeInputs:
    """Rank 0's half of a step: which seats decode, where their blocks sit in the input, and which
    logit rows are greedy positions (first) or whole blocks of full rows (after, bl each)."""

    requests: list[Request]
    slots: np.ndarray  # [R]
    block_index: np.ndarray  # [R * bl] flat token index of each decoding row's active block
    greedy_target: np.ndarray  # [Pg] index into [R * bl] of each greedy logit row
    full_rows: np.ndarray  # [F] rows with whole-block full logits (temperature > 0 or a needs_logits decoder)
    log_len: np.ndarray  # [R] rows each row's decoder has logged in this block (its host log's length)
    decoders: list[str]  # decoders present in the batch
    owners: np.ndarray  # [R, 2] (request serial, active block): the step state a seat must hold
    constrained: np.ndarray  # [C] rows with a grammar: the block-aware rule runs on them (engine/constraint/rule.py)
