"""One request's canvas of blocks: its tokens, geometry and counters, as the scheduler sees it.

The canvas is ceil((prompt + max_new_tokens) / block_length) blocks aligned to position 0. Blocks
before `active_block` hold final tokens; `num_cached_blocks` of them have K/V in the cache. A block
becomes final only when the decoder says so, and its K/V is written by the next forward that runs
it with those final tokens (a prefill chunk or the fused commit + first step of the next block).

Only Scheduler.postprocess (a step's results) and the scheduler's admission/preemption change a
Request after it is queued; `tokens` is the host mirror of the device's active block.
"""
from __future__ import annotations

import itertools
from typing import Optional

import numpy as np
import torch

from fluxlab.engine.request import RequestState, RequestStats, SamplingParams


_serials = itertools.count()


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, block_length: int,
                 mask_id: int, eos_ids: tuple[int, ...], hidden_ids: tuple[int, ...] = ()):
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
        self.tokens = np.full(self.num_blocks * block_length, mask_id, dtype=np.int64)
        self.tokens[:self.num_prompt_tokens] = prompt_ids
        # Blocks wholly inside the prompt are final from the start; the prompt's tail block is decoded.
        self.active_block = self.num_prompt_tokens // block_length
        self.num_cached_blocks = 0
        self.page_table: list[int] = []
        self.slot: Optional[int] = None  # the running seat whose device step state is this request's
        self.state = RequestState.WAITING
        self.stats = RequestStats()
        self.forwards_in_block = 0  # forwards that decoded the active block so far
        # Host mirror of the device decoder state (decoding/base.py; all empty = zero on block entry):
        self.decoder_state: dict[str, int] = {}  # counters
        self.decoder_columns: dict[str, np.ndarray] = {}  # [block_length] int64 each
        self.decoder_log: list[np.ndarray] = []  # rows logged in the active block, [block_length] each
        self.output_ids: list[int] = []  # final output so far (cut at EOS / max_new_tokens / stop)
        self.num_emitted = 0  # output tokens already reported
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None  # why the engine failed this request (finish_reason "error")
        self.text: Optional[str] = None
        self.detokenizer = None  # set by the engine when stop strings need the text
        self.last_scheduled_step = -1
        self.generator: Optional[torch.Generator] = None  # created by the decode step when sampling

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
    def commit_active_block(self) -> list[int]:
        """The active block's tokens are final: extend the output, maybe finish; returns new output ids."""
        params = self.params
        start, end = self.block_range(self.active_block)
        out_start = max(start, self.num_prompt_tokens)
        out_end = min(end, self.num_prompt_tokens + params.max_new_tokens)
        new = self.tokens[out_start:out_end].tolist()
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
        self.active_block += 1
        self.forwards_in_block = 0
        self.decoder_state, self.decoder_columns, self.decoder_log = {}, {}, []
        if self.finish_reason is None and self.active_block >= self.num_blocks:
            self.finish_reason = "length"
        return new

    def reset_for_preemption(self) -> None:
        """Pages are gone; final blocks are re-prefilled later, the active block keeps its tokens
        and decoder state (the host mirror), so preemption changes no token."""
        self.num_cached_blocks = 0
        self.page_table = []
        self.slot = None
        self.state = RequestState.WAITING
        self.stats.preemptions += 1
