"""Diffusion-Gemma's two page pools: full-attention layers keep a page per canvas (BlockManager's
pool, unchanged), sliding layers keep a ring of `ring_size = ceil(window / L) + 1` pages per request.

A sliding query at index q sees keys from q - window + 1 on, so once a request's K/V covers blocks
[0, e) no later query reads below block e - ceil((window - 1) / L): a request needs at most that
many old blocks plus the one being written. Block b's sliding K/V lives on ring[b % ring_size]
(canvas_attention.py writes only the blocks a later query can see and reads its own forward's keys
from the forward itself), so a ring never grows past ring_size pages.

The ring is handed out with the full pages (`allocate` tops it up to min(ring_size, pages held)) and
returned with them (`free`), so admission, preemption and release stay BlockManager's. The pool
holds ring_size pages per seat, so it never runs out and needs no admission check of its own.

No prefix cache: a cached block's full-layer K/V outlives its request, its sliding K/V does not
(the ring is reused), so a hit could not be served; config validation refuses
scheduler.enable_prefix_cache=true for Diffusion-Gemma.
"""
from __future__ import annotations

import math
from collections import Counter, deque
from typing import Iterable

from fluxlab.engine.block_manager import BlockManager
from fluxlab.engine.sequence import Request


def sliding_ring_size(window: int, canvas_length: int) -> int:
    """Pages a sliding layer needs per request: the window's blocks plus the one being written."""
    return math.ceil(window / canvas_length) + 1


class CanvasBlockManager(BlockManager):
    def __init__(self, num_pages: int, layout: str, pages_per_slot: int, num_seats: int, max_blocks_per_seq: int,
                 ring_size: int, enable_prefix_cache: bool = False):
        if enable_prefix_cache:
            raise ValueError("scheduler.enable_prefix_cache=true: Diffusion-Gemma's sliding layers keep only "
                             "their window's pages, so a cached block's sliding K/V is gone; set it to false")
        super().__init__(num_pages, layout, pages_per_slot=pages_per_slot, num_seats=num_seats,
                         max_blocks_per_seq=max_blocks_per_seq)
        self.ring_size = ring_size
        self.num_sliding_pages = num_seats * ring_size
        self.free_sliding_pages: deque[int] = deque(range(self.num_sliding_pages))

    @property
    def num_free_sliding_pages(self) -> int:
        return len(self.free_sliding_pages)

    def allocate(self, request: Request, num_blocks: int, hits=()) -> None:
        super().allocate(request, num_blocks, hits)
        ring = request.sliding_pages
        while len(ring) < min(self.ring_size, len(request.page_table)):
            ring.append(self.free_sliding_pages.popleft())

    def free(self, request: Request) -> None:
        self.free_sliding_pages.extend(request.sliding_pages)
        request.sliding_pages = []
        super().free(request)

    def check(self, requests: Iterable[Request]) -> None:
        requests = list(requests)
        super().check(requests)
        holders = Counter(page for request in requests for page in request.sliding_pages)
        free = set(self.free_sliding_pages)
        problems = [f"{r.request_id} holds {len(r.sliding_pages)} sliding pages > ring {self.ring_size}"
                    for r in requests if len(r.sliding_pages) > self.ring_size]
        if len(free) != len(self.free_sliding_pages) or any(n > 1 for n in holders.values()):
            problems.append("a sliding page is twice in the free list or held twice")
        if free & set(holders) or len(free) + len(holders) != self.num_sliding_pages:
            problems.append(f"sliding pages: free {len(free)} + held {len(holders)} != total {self.num_sliding_pages}")
        if problems:
            raise AssertionError("sliding KV page accounting: " + "; ".join(problems))
