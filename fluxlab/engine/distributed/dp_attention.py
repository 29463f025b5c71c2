"""Data-parallel attention (parallel.enable_dp_attention, DESIGN §7) on top of the TP machinery.

Every rank holds the whole model except the routed experts, which are split over all ranks
(layers/moe_dispatch.py moves the tokens). Each rank has its own KV pool and runs attention on its
own requests only. Rank 0 is the front end: one scheduler over `DataParallelPages` (one block
manager per rank, page ids numbered across ranks so a page says its rank; a request is placed on
a rank when it is admitted), one decode step on rank 0. Per step `DataParallelRunner` cuts the
batch by rank, sends each worker its part on its own step channel, runs its own part, and gathers
the other ranks' logit rows (greedy statistics, or full rows for sampling) to rank 0. A rank
with no rows runs a one-block dummy on its scratch page, so every rank joins every collective.
scheduler.max_num_seqs and max_scheduled_tokens are the engine's, over all ranks together.
Eager only (validate.py refuses CUDA graphs: each rank's token count changes every step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np
import torch
import torch.distributed as dist

from fluxlab.engine.block_manager import BlockManager, CachedBlock
from fluxlab.engine.model_runner import ModelRunner
from fluxlab.engine.runner_inputs import StepInputs
from fluxlab.engine.sequence import Request


class DataParallelPages:
    """The scheduler's block manager under DP attention: rank r's pages are [r * N, (r + 1) * N)."""

    def __init__(self, managers: list[BlockManager], pages_per_rank: int):
        self.managers = managers
        self.pages_per_rank = pages_per_rank
        self.layout = managers[0].layout
        self.enable_prefix_cache = managers[0].enable_prefix_cache
        self.holders = [0] * len(managers)  # requests holding pages on each rank

    def rank_of(self, request: Request) -> Optional[int]:
        if request.page_table:
            return request.page_table[0] // self.pages_per_rank
        return getattr(request, "dp_rank", None)

    def _place(self, request: Request) -> int:
        """A request without pages goes where most of its prompt is cached, else to the rank with
        the fewest requests (then the most free pages)."""
        hits = [len(m.match(request)) for m in self.managers]
        rank = min(range(len(self.managers)),
                   key=lambda r: (-hits[r], self.holders[r], -self.managers[r].num_free_pages, r))
        request.dp_rank = rank
        return rank

    def _manager(self, request: Request) -> BlockManager:
        rank = self.rank_of(request)
        return self.managers[self._place(request) if rank is None else rank]

    # --- the BlockManager interface the scheduler and the engine use ---
    @property
    def seat_pages(self):
        return self.managers[0].seat_pages  # shared by every rank's pool (engine._spread_over_ranks)

    @property
    def seat_num_pages(self):
        return self.managers[0].seat_num_pages

    @property
    def num_pages(self) -> int:
        return sum(m.num_pages for m in self.managers)

    @property
    def num_free_pages(self) -> int:
        return sum(m.num_free_pages for m in self.managers)

    @property
    def num_cached_pages(self) -> int:
        return sum(m.num_cached_pages for m in self.managers)

    @property
    def num_queried_blocks(self) -> int:
        return sum(m.num_queried_blocks for m in self.managers)

    @property
    def num_hit_blocks(self) -> int:
        return sum(m.num_hit_blocks for m in self.managers)

    def can_hold(self, request: Request) -> bool:
        return self.managers[0].can_hold(request)  # every rank's pool is the same size

    def match(self, request: Request) -> list[CachedBlock]:
        if request.page_table:
            return []
        return self.managers[self._place(request)].match(request)

    def can_allocate(self, request: Request, num_blocks: int, hits: list[CachedBlock] = ()) -> bool:
        return self._manager(request).can_allocate(request, num_blocks, hits)

    def allocate(self, request: Request, num_blocks: int, hits: list[CachedBlock] = ()) -> None:
        manager = self._manager(request)
        if not request.page_table:
            self.holders[self.managers.index(manager)] += 1
        manager.allocate(request, num_blocks, hits)

    def extend(self, requests: list[Request], num_blocks: list[int]) -> None:
        for request, n in zip(requests, num_blocks):  # each on its own rank's pool
            self.allocate(request, n)

    def cache_blocks(self, request: Request, first: int, end: int) -> None:
        self._manager(request).cache_blocks(request, first, end)

    def cache_rows(self, requests: list[Request], first: list[int], end: list[int], first_tokens: np.ndarray) -> None:
        for request, a, b in zip(requests, first, end):  # each on its own rank's pool, in row order
            self.cache_blocks(request, a, b)

    def free(self, request: Request) -> None:
        rank = self.rank_of(request)
        if request.page_table:
            self.holders[rank] -= 1
        if rank is not None:
            self.managers[rank].free(request)
        request.dp_rank = None  # placed again when it is admitted again

    def check(self, requests: Iterable[Request]) -> None:
        requests = list(requests)
        for rank, manager in enumerate(self.managers):
            manager.check([r for r in requests if r.page_table and self.rank_of(r) == rank])


@dataclass
class RankPart:
    inputs: StepInputs  # rows of this rank, pages in rank 0's numbering, logit ids into its own tokens
    greedy_at: np.ndarray  # where its greedy logit rows go among the step's greedy rows
    others_at: np.ndarray  # where its other logit rows go among the step's other rows


def split_by_rank(inputs: StepInputs, pages_per_rank: int, world: int, block_length: int) -> list[RankPart]:
    """Cut one step's inputs into each rank's part (a row runs where its pages are)."""
    rows = inputs.rows
    row_rank = np.array([table[first] // pages_per_rank for first, _, _, table in rows], dtype=np.int64)
    lengths = np.array([n * block_length for _, n, _, _ in rows], dtype=np.int64)
    token_rank = np.repeat(row_rank, lengths)
    local_index = np.zeros(token_rank.shape[0], dtype=np.int64)
    greedy, others = inputs.logit_index[:inputs.num_greedy], inputs.logit_index[inputs.num_greedy:]
    parts = []
    for rank in range(world):
        mine = token_rank == rank
        local_index[mine] = np.arange(int(mine.sum()))
        chosen = np.flatnonzero(row_rank == rank)
        greedy_at = np.flatnonzero(token_rank[greedy] == rank)
        others_at = np.flatnonzero(token_rank[others] == rank)
        seats = None if inputs.seats is None else [inputs.seats[i] for i in chosen]
        part = StepInputs(inputs.token_ids[mine], inputs.positions[mine], [rows[i] for i in chosen],
                          np.concatenate([local_index[greedy[greedy_at]], local_index[others[others_at]]]),
                          int(greedy_at.shape[0]), seats=seats)
        parts.append(RankPart(part, greedy_at, others_at))
    return parts


def dummy_inputs(runner: ModelRunner) -> StepInputs:
    """One block on the scratch page, no logits: what an idle rank runs to join the collectives."""
    bl = runner.block_length
    return StepInputs(np.zeros(bl, dtype=np.int64), np.arange(bl), [(0, 1, False, [runner.scratch_page])],
                      np.zeros(0, dtype=np.int64))


def step_sizes(parts: list[RankPart], block_length: int) -> list[int]:
    """What rank 0 sends every worker with its part: tokens per rank (an idle rank's dummy block),
    then the most greedy and the most other logit rows any rank has (the gathers' padded sizes)."""
    tokens = [p.inputs.token_ids.shape[0] or block_length for p in parts]
    greedy = max(p.inputs.num_greedy for p in parts)
    others = max(p.inputs.logit_index.shape[0] - p.inputs.num_greedy for p in parts)
    return tokens + [greedy, others]


def run_rank_part(runner: ModelRunner, inputs: StepInputs, sizes: list[int], world: int):
    """Run this rank's part of a step (a dummy when it has none) and gather its logit rows to rank
    0. Returns, on rank 0, (greedy parts [world] of [max, 2] float64 (token, probability), other
    logit parts [world] of [max, V]); None elsewhere."""
    runner.model.dispatch.counts = sizes[:world]
    max_greedy, max_others = sizes[world], sizes[world + 1]
    # ModelRunner's own forward (rank 0's DataParallelRunner.execute is this whole step)
    greedy, logits, _, _ = ModelRunner.execute(runner, inputs if inputs.rows else dummy_inputs(runner))
    device = runner.device
    greedy_parts = other_parts = None
    if max_greedy:
        packed = torch.zeros(max_greedy, 2, dtype=torch.float64, device=device)
        if greedy is not None:
            packed[:greedy[0].shape[0], 0] = greedy[0].double()
            packed[:greedy[0].shape[0], 1] = greedy[1].double()
        greedy_parts = _gather(packed, world)
    if max_others:
        vocab = runner.model.config.vocab_size
        dtype = torch.float32 if runner.fp32_logits else runner.dtype
        padded = torch.zeros(max_others, vocab, dtype=dtype, device=device)
        if logits is not None:
            padded[:logits.shape[0]] = logits
        other_parts = _gather(padded, world)
    if dist.get_rank() != 0:
        return None
    return greedy_parts, other_parts


def _gather(t: torch.Tensor, world: int) -> Optional[list[torch.Tensor]]:
    parts = [torch.empty_like(t) for _ in range(world)] if dist.get_rank() == 0 else None
    dist.gather(t, parts, dst=0)
    return parts


class DataParallelRunner(ModelRunner):
    """Rank 0's runner under DP attention: `execute` runs a step over every rank (see module doc)."""

    channels: list = []  # one StepWriter per worker (rank 1..), set by ParallelEngine
    pages_per_rank = 0
    world = 1

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, extra: list[np.ndarray] = ()):
        if not self.channels:  # before the workers are attached: the memory profile, run alike everywhere
            return super().execute(inputs, extra)
        bl, world = self.block_length, self.world
        parts = split_by_rank(inputs, self.pages_per_rank, world, bl)
        sizes = step_sizes(parts, bl)
        for channel, part in zip(self.channels, parts[1:]):
            channel.send(part.inputs, sizes)  # BrokenPipeError if that worker is gone
        greedy_parts, other_parts = run_rank_part(self, parts[0].inputs, sizes, world)
        greedy = logits = None
        if inputs.num_greedy:
            tokens = torch.empty(inputs.num_greedy, dtype=torch.long, device=self.device)
            probs = torch.empty(inputs.num_greedy, dtype=torch.float32, device=self.device)
            for part, got in zip(parts, greedy_parts):
                at = torch.from_numpy(part.greedy_at).to(self.device)
                tokens.index_copy_(0, at, got[:at.shape[0], 0].long())
                probs.index_copy_(0, at, got[:at.shape[0], 1].float())
            greedy = (tokens, probs)
        num_others = inputs.logit_index.shape[0] - inputs.num_greedy
        if num_others:
            logits = torch.empty(num_others, other_parts[0].shape[1], dtype=other_parts[0].dtype, device=self.device)
            for part, got in zip(parts, other_parts):
                at = torch.from_numpy(part.others_at).to(self.device)
                logits.index_copy_(0, at, got[:at.shape[0]])
        # A plain copy, not the pinned staging buffer: this rank's own part is still reading it.
        arrays = [inputs.token_ids.astype(np.int64, copy=False), *extra]
        uploaded = torch.from_numpy(np.concatenate(arrays)).to(self.device) if arrays else None
        ids, *extra_dev = torch.split(uploaded, [a.shape[0] for a in arrays])
        return greedy, logits, ids, list(extra_dev)
