"""KV page accounting: the only code that touches page tables.

A page holds one block's K/V (page size = block length). `paged` hands out any free page per block;
`dense` gives each running request one contiguous slot of max_model_len / block_length pages, so the
same paged attention code serves both layouts.
"""
from __future__ import annotations

from collections import deque

from fluxlab.engine.sequence import Request


class BlockManager:
    def __init__(self, num_pages: int, layout: str = "paged", pages_per_slot: int = 0):
        if layout == "dense":
            if pages_per_slot < 1 or num_pages < pages_per_slot:
                raise ValueError(f"dense KV layout needs at least one slot of {pages_per_slot} pages, "
                                 f"the budget holds {num_pages}")
            num_pages -= num_pages % pages_per_slot
            self.free_slots: deque[int] = deque(range(num_pages // pages_per_slot))
        self.layout = layout
        self.pages_per_slot = pages_per_slot
        self.num_pages = num_pages
        self.free_pages: deque[int] = deque(range(num_pages))

    @property
    def num_free_pages(self) -> int:
        if self.layout == "dense":
            return len(self.free_slots) * self.pages_per_slot
        return len(self.free_pages)

    def can_hold(self, request: Request) -> bool:
        """Could this request ever run (its whole canvas) with the cache empty?"""
        if self.layout == "dense":
            return request.num_blocks <= self.pages_per_slot
        return request.num_blocks <= self.num_pages

    def pages_missing(self, request: Request, num_blocks: int) -> int:
        if self.layout == "dense":
            return 0 if request.page_table else self.pages_per_slot
        return max(0, num_blocks - len(request.page_table))

    def can_allocate(self, request: Request, num_blocks: int) -> bool:
        if self.layout == "dense":
            return bool(request.page_table) or bool(self.free_slots)
        return self.pages_missing(request, num_blocks) <= len(self.free_pages)

    def allocate(self, request: Request, num_blocks: int) -> None:
        """Make the request's page table cover its first `num_blocks` blocks."""
        if not self.can_allocate(request, num_blocks):
            raise RuntimeError("allocate() without can_allocate()")
        if self.layout == "dense":
            if not request.page_table:
                slot = self.free_slots.popleft()
                request.page_table = list(range(slot * self.pages_per_slot, (slot + 1) * self.pages_per_slot))
            return
        while len(request.page_table) < num_blocks:
            request.page_table.append(self.free_pages.popleft())

    def free(self, request: Request) -> None:
        if self.layout == "dense":
            if request.page_table:
                self.free_slots.append(request.page_table[0] // self.pages_per_slot)
        else:
            self.free_pages.extend(request.page_table)
        request.page_table = []
        request.num_cached_blocks = 0
