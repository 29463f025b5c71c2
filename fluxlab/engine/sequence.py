"""One request's canvas of blocks as the scheduler sees it.

The canvas is ceil((prompt + max_new_tokens) / block_length) blocks aligned to position 0. Blocks
before `active_block` hold final tokens; `num_cached_blocks` of them have K/V in the cache. A block
becomes final only when the decoder says so, and its K/V is written by the next forward that runs
it with those final tokens (a prefill chunk or the fused commit + first step of the next block).
"""
from __future__ import annotations

from typing import Optional

import torch

from fluxlab.engine.request import RequestState, RequestStats, SamplingParams


def transfer_schedule(block_length: int, steps: int) -> list[int]:
    """Tokens to accept at each step of a block: block_length // steps, the first remainder steps +1."""
    base, extra = divmod(block_length, steps)
    return [base + (1 if s < extra else 0) for s in range(steps)]


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, block_length: int,
                 mask_id: int, eos_id: int):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.block_length = block_length
        self.mask_id = mask_id
        self.eos_id = eos_id
        self.num_prompt_tokens = len(prompt_ids)
        total = self.num_prompt_tokens + params.max_new_tokens
        self.num_blocks = -(-total // block_length)
        self.tokens = self.prompt_ids + [mask_id] * (self.num_blocks * block_length - self.num_prompt_tokens)
        # Blocks wholly inside the prompt are final from the start; the prompt's tail block is decoded.
        self.active_block = self.num_prompt_tokens // block_length
        self.num_cached_blocks = 0
        self.page_table: list[int] = []
        self.state = RequestState.WAITING
        self.stats = RequestStats()
        self.step_in_block = 0  # transfer-schedule index s within the active block
        self.post_steps = 0  # joint_threshold: forwards since the block ran out of masks
        self.schedule = transfer_schedule(block_length, min(params.steps, params.max_new_tokens))
        self.output_ids: list[int] = []  # final output so far (cut at EOS / max_new_tokens / stop)
        self.num_emitted = 0  # output tokens already reported
        self.finish_reason: Optional[str] = None
        self.text: Optional[str] = None
        self.last_scheduled_step = -1
        self.generator: Optional[torch.Generator] = None  # created by the decoder when sampling

    # --- geometry ---
    def block_range(self, block: int) -> tuple[int, int]:
        return block * self.block_length, (block + 1) * self.block_length

    def block_tokens(self, block: int) -> list[int]:
        start, end = self.block_range(block)
        return self.tokens[start:end]

    @property
    def num_final_blocks(self) -> int:
        return self.active_block

    @property
    def is_finished(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.ABORTED)

    @property
    def num_pages_needed(self) -> int:
        """Pages for every block up to and including the active one."""
        return self.active_block + 1

    def num_prompt_positions_in_active_block(self) -> int:
        start, _ = self.block_range(self.active_block)
        return max(0, min(self.num_prompt_tokens - start, self.block_length))

    def transfer_count(self) -> int:
        """k[s] of the transfer schedule for the active block's current step."""
        return self.schedule[min(self.step_in_block, len(self.schedule) - 1)]

    # --- progress ---
    def set_active_block_tokens(self, block_tokens: list[int]) -> None:
        start, end = self.block_range(self.active_block)
        self.tokens[start:end] = block_tokens

    def finish_active_block(self) -> list[int]:
        """The active block's tokens are final: update the output, maybe finish; returns new output ids."""
        params = self.params
        start, end = self.block_range(self.active_block)
        out_start = max(start, self.num_prompt_tokens)
        out_end = min(end, self.num_prompt_tokens + params.max_new_tokens)
        new = self.tokens[out_start:out_end]
        if not params.ignore_eos and self.eos_id in new:
            new = new[: new.index(self.eos_id)]
            self.finish_reason = "stop"
        self.output_ids.extend(new)
        self.stats.blocks_committed += 1
        self.active_block += 1
        self.step_in_block = 0
        self.post_steps = 0
        if self.finish_reason is None and self.active_block >= self.num_blocks:
            self.finish_reason = "length"
        return new

    def reset_for_preemption(self) -> None:
        """Pages are gone; final blocks are re-prefilled later, the active block keeps its tokens."""
        self.num_cached_blocks = 0
        self.page_table = []
        self.state = RequestState.WAITING
        self.stats.preemptions += 1
