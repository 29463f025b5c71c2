"""One request's canvas of blocks: its tokens, geometry and counters, as the scheduler sees it.

The canvas is ceil((prompt + max_new_tokens) / block_length) blocks aligned to position 0. Blocks
before `active_block` hold final tokens; `num_cached_blocks` of them have K/V in the cache. A block
becomes final only when the decoder says so, and its K/V is written by the next forward that runs
it with those final tokens (a prefill chunk or the fused commit + first step of the next block),
unless the forward that made it final changed none of its tokens: that forward's K/V is already
computed over the final tokens (editing decoders end blocks so), and the block is cached at once.

Only Scheduler.postprocess (a step's results) and the scheduler's admission/preemption change a
Request after it is queued; `tokens` is the host mirror of the device's active block.

While a request holds a seat, its canvas, progress counters and decoder state live in the seat's
arrays (seats.py) and the attributes below read and write through to them; seat_out copies them
back, so the attributes mean the same whether the request is seated or not.
"""
from __future__ import annotations

import itertools
from typing import Optional

import numpy as np
import torch

from fluxlab.engine.request import RequestState, RequestStats, SamplingParams


_serials = itertools.count()

# Progress counters that live in the request's seat while it has one (seats.py).
SEATED = ("active_block", "num_cached_blocks", "forwards_in_block", "last_scheduled_step")


def _seated(name: str) -> property:
    """An int counter that lives in the request's seat while it has one (SEATED)."""

    def get(self) -> int:
        seats = self._seats
        if seats is not None:
            return int(getattr(seats, name)[self.slot])
        try:
            return self.__dict__[name]
        except KeyError:
            raise AttributeError(name) from None

    def put(self, value: int) -> None:
        seats = self._seats
        if seats is None:
            self.__dict__[name] = value
        else:
            getattr(seats, name)[self.slot] = value

    return property(get, put)


class Request:
    active_block = _seated("active_block")
    num_cached_blocks = _seated("num_cached_blocks")
    forwards_in_block = _seated("forwards_in_block")
    last_scheduled_step = _seated("last_scheduled_step")

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, block_length: int,
                 mask_id: int, eos_ids: tuple[int, ...], hidden_ids: tuple[int, ...] = ()):
        self._seats = None  # the Seats whose arrays hold this request's progress while it is seated
        self.slot: Optional[int] = None  # the running seat whose host and device step state is this request's
        self.request_id = request_id
        self.serial = next(_serials)  # unique for the process's life (request ids may be reused)
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.block_length = block_length
        self.mask_id = mask_id
        self.eos_ids = tuple(eos_ids)
        self.hidden_ids = frozenset(hidden_ids)  # never emitted (LLaDA2.2's DELETE/SPLIT edit tokens)
        self.num_prompt_tokens = len(prompt_ids)
        total = self.num_prompt_tokens + params.max_new_tokens
        self.num_blocks = -(-total // block_length)
        self._tokens = np.full(self.num_blocks * block_length, mask_id, dtype=np.int64)
        self._tokens[:self.num_prompt_tokens] = prompt_ids
        # Blocks wholly inside the prompt are final from the start; the prompt's tail block is decoded.
        self.active_block = self.num_prompt_tokens // block_length
        self.num_cached_blocks = 0
        self.page_table: list[int] = []
        self.state = RequestState.WAITING
        self.stats = RequestStats()
        self.forwards_in_block = 0  # forwards that decoded the active block so far
        # Host mirror of the device decoder state (decoding/base.py; all empty = zero on block entry):
        self._decoder_state: dict[str, int] = {}  # counters
        self._decoder_columns: dict[str, np.ndarray] = {}  # [block_length] int64 each
        self.decoder_log: list[np.ndarray] = []  # rows logged in the active block, [block_length] each
        self.output_ids: list[int] = []  # final output so far (cut at EOS / max_new_tokens / stop)
        self.num_emitted = 0  # output tokens already reported
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None  # why the engine failed this request (finish_reason "error")
        self.text: Optional[str] = None
        self.detokenizer = None  # set by the engine when stop strings need the text
        self.last_scheduled_step = -1
        self.generator: Optional[torch.Generator] = None  # created by the decode step when sampling
        self.constraint = None  # engine/constraint Constraint of params.grammar (Scheduler.add makes it)

    # --- seat ---
    def seat_in(self, seats, seat: int) -> None:
        """Called by Seats.attach once the seat holds this request's values."""
        self._seats, self.slot = seats, seat

    def seat_out(self) -> None:
        """Called by Seats.detach: the seat's values become the request's own again."""
        seats, seat = self._seats, self.slot
        for name in SEATED:
            self.__dict__[name] = int(getattr(seats, name)[seat])
        self._tokens = seats.tokens[seat, :self._tokens.shape[0]].copy()
        self._decoder_state = seats.decoder_state(seat)
        self._decoder_columns = seats.decoder_columns(seat)
        self._seats, self.slot = None, None

    @property
    def tokens(self) -> np.ndarray:
        """The canvas [num_blocks * block_length] (a view of the seat's row while seated)."""
        if self._seats is None:
            return self._tokens
        return self._seats.tokens[self.slot, :self._tokens.shape[0]]

    @property
    def decoder_state(self) -> dict[str, int]:
        return self._decoder_state if self._seats is None else self._seats.decoder_state(self.slot)

    @property
    def decoder_columns(self) -> dict[str, np.ndarray]:
        return self._decoder_columns if self._seats is None else self._seats.decoder_columns(self.slot)

    # --- random draws ---
    def sampler_state(self) -> Optional[torch.Tensor]:
        """Where this request's draws stand (None: it has not drawn yet). A failed step puts it back
        (`restore_sampler_state`), so the retry draws the numbers the request would draw alone."""
        return None if self.generator is None else self.generator.get_state()

    def restore_sampler_state(self, state: Optional[torch.Tensor]) -> None:
        if state is None:
            self.generator = None  # seeded again at its next draw
        else:
            self.generator.set_state(state)

    # --- geometry ---
    def block_range(self, block: int) -> tuple[int, int]:
        return block * self.block_length, (block + 1) * self.block_length

    @property
    def active_tokens(self) -> np.ndarray:
        start, end = self.block_range(self.active_block)
        return self.tokens[start:end]

    @property
    def is_finished(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.ABORTED)

    @property
    def in_block(self) -> bool:
        """Inside a block: the active block has had a forward and is not final yet."""
        return self.num_cached_blocks == self.active_block and self.forwards_in_block > 0

    def prompt_positions_in_active_block(self) -> int:
        start, _ = self.block_range(self.active_block)
        return max(0, min(self.num_prompt_tokens - start, self.block_length))

    # --- progress (called by Scheduler.postprocess only) ---
    def commit_block(self, block: int, block_tokens: list[int]) -> list[int]:
        """Block `block` (the active one) is final with these tokens: extend the output, maybe finish;
        returns the new output ids. The scheduler moves the active block on (in the request's seat)."""
        params = self.params
        start = block * self.block_length
        out_start = max(start, self.num_prompt_tokens) - start
        out_end = min(start + self.block_length, self.num_prompt_tokens + params.max_new_tokens) - start
        new = block_tokens[out_start:out_end]
        if not params.ignore_eos:
            stops = [new.index(e) for e in self.eos_ids if e in new]
            if stops:
                new = new[:min(stops)]
                self.finish_reason = "stop"
        if self.hidden_ids:
            # levenshtein_joint never leaves an edit token in a block; other decoders may accept one
            # on an LLaDA2.2 model, and it is an instruction to the decoder, not text.
            new = [t for t in new if t not in self.hidden_ids]
        self.output_ids.extend(new)
        self.stats.blocks_committed += 1
        if self.decoder_log:
            self.decoder_log = []
        if self.finish_reason is None and block + 1 >= self.num_blocks:
            self.finish_reason = "length"
        return new

    def reset_for_preemption(self) -> None:
        """Pages are gone; final blocks are re-prefilled later, the active block keeps its tokens
        and decoder state (the host mirror), so preemption changes no token."""
        self.num_cached_blocks = 0
        self.page_table = []
        self.state = RequestState.WAITING
        self.stats.preemptions += 1
