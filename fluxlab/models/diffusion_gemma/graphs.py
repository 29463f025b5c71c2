"""Denoiser graphs for Diffusion-Gemma: static denoising steps by (padded rows, key pages).

The canvas runner asks `can_run(batch)`: a batch whose rows each denoise their canvas, alone or
right after committing one block (the canvas just accepted, or a prompt's last block), at most the
largest row size, runs on a `StaticDenoiser` (canvas_static.py): the denoise-only graph when no
row commits, else the commit graph (2L tokens a row; a row committing nothing writes its dummy
block to the scratch page). Every other batch (a prefill of several blocks, a commit without a
canvas, more rows, a row with a grammar) runs eagerly. Rows are padded to the smallest size of the ladder that holds
them (attention.cuda_graph_capture_bs and every multiple of ROW_LADDER_STEP up to the largest), full-layer keys to a power of two pages of the batch's longest prefix
(so a short prefix does not pay for max_model_len; sliding layers always gather their window).

Capture is lazy: a (rows, key pages, commits) graph is captured the first time a batch needs it (a
serving run meets a few of the rows x buckets pairs, a 26B-A4B capture costs three forwards, and
capturing the whole ladder up front would take minutes), all into one memory pool; the first step
of each size pays that once. Outputs are copied out right after each replay, so graphs sharing the
pool may replay in any order. With `capture=False` the same static path is called as is: the CPU
tests run it against transformers.
"""
from __future__ import annotations

import logging
import time

import torch

from fluxlab.models.diffusion_gemma.static import StaticDenoiser
from fluxlab.engine.batch import ScheduledBatch

log = logging.getLogger("fluxlab.engine")


# Denoiser graphs are captured when first needed (seconds each at 26B-A4B), so their ladder is
# sparser than LLMEngine's (graph_runner.ladder_sizes, captured up front in ~0.1 s a graph).
ROW_LADDER_STEP = 4


def denoise_row_sizes(capture_bs: list[int], ladder_step: int = ROW_LADDER_STEP) -> list[int]:
    """Row counts to pad to: each capture size and every multiple of ladder_step up to the largest."""
    largest = max(capture_bs)
    return sorted(set(capture_bs) | set(range(ladder_step, largest + 1, ladder_step)))


class CanvasGraphs:
    def __init__(self, runner, row_sizes: list[int], capture: bool):
        self.runner = runner
        self.sizes = sorted(set(row_sizes))
        self.capture = capture
        self.max_key_pages = runner.pages_per_seq - 1
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.denoisers: dict[tuple[int, int, bool], StaticDenoiser] = {}

    def can_run(self, batch: ScheduledBatch) -> bool:
        """Every row denoises its canvas, alone or after committing one block that holds no left
        padding (a committed canvas, or a prompt's last block), the rows fit the largest size, and
        none holds a grammar (constrained.py's mask and walk sit between the logits and the sampler)."""
        if not 0 < len(batch.requests) <= self.sizes[-1] or not batch.decodes.all():
            return False
        if any(r.constraint is not None for r in batch.requests):  # the canvas rule's host work runs eagerly
            return False
        if (batch.num_blocks == 1).all():
            return True
        L = self.runner.block_length
        return bool((batch.num_blocks <= 2).all()) and all(
            r.num_pad <= (r.active_block - 1) * L for r, n in zip(batch.requests, batch.num_blocks) if n == 2)

    def key_pages(self, requests) -> int:
        """Pages of prefix keys the full layers gather: a power of two >= the longest row's."""
        L = self.runner.block_length
        longest = max(max(0, r.active_block * L - r.num_pad) for r in requests)
        pages = 1
        while pages * L < longest:
            pages *= 2
        return min(pages, self.max_key_pages)

    def denoiser(self, num_rows: int, key_pages: int, with_sampler: bool = True,
                 commits: bool = False) -> StaticDenoiser:
        """The static step for num_rows rows (padded up the ladder); `commits`: the graph whose rows
        may commit a block first (2L tokens a row), else the denoise-only one."""
        rows = next(s for s in self.sizes if s >= num_rows)
        encoder = self.runner.block_length if commits else 0
        key = (rows, key_pages, with_sampler, encoder)
        if key not in self.denoisers:
            started = time.perf_counter()
            self.denoisers[key] = StaticDenoiser(self.runner, rows, key_pages, self.capture, self.pool, with_sampler,
                                                 encoder)
            if self.capture:
                log.info("captured the denoiser graph of %d rows, %d key pages%s%s in %.1f s", rows, key_pages,
                         ", commits" if commits else "", "" if with_sampler else " (forward only)",
                         time.perf_counter() - started)
        return self.denoisers[key]

    def run(self, requests, states, commits: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """(block [n, L], final [n]) of one denoising step of these rows (`can_run`)."""
        denoiser = self.denoiser(len(requests), self.key_pages(requests), commits=any(commits))
        return denoiser.run(requests, states, commits)

    def release(self) -> None:
        if self.capture:
            torch.cuda.synchronize(self.runner.device)
        self.denoisers.clear()
