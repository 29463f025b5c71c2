"""KV page accounting: the only code that touches page tables.

A page holds one block's K/V (page size = block length). `paged` hands out any free page per block;
`dense` gives each running request one contiguous slot of max_model_len / block_length pages, so the
same paged attention code serves both layouts.

Prefix cache (paged only, DESIGN §6): a block's K/V depends only on the tokens in and before it, and
blocks are aligned to position 0, so a final block whose K/V a forward has written is keyed by
(its parent's entry, its tokens) and reused by any request whose leading blocks are the same tokens.
The key holds the tokens themselves, not a digest: the dict compares them exactly, so no collision
can hand a request the K/V of other tokens, and an entry's serial is never reused, so a child can
never attach to a different parent after its own was evicted. Entries are reference counted by the
page tables that hold them; unreferenced entries stay until their page is needed (LRU, leaves first).

Every page is in exactly one of: free, cached and unreferenced (reclaimable), in use by requests.
`num_free_pages` counts the first two (what admission and /get_load can count on).

`seat_pages` / `seat_num_pages` mirror the page table of each seated request (seats.py) as numpy
rows, written here whenever a table changes, so the runner builds slot mappings without a Python
loop over rows.
"""
from __future__ import annotations

import itertools
from collections import Counter, OrderedDict, deque
from typing import Iterable

import numpy as np

from fluxlab.engine.sequence import Request


class CachedBlock:
    """One final block's page in the prefix cache."""

    __slots__ = ("key", "serial", "page", "refs")

    def __init__(self, key: tuple[int, bytes], serial: int, page: int):
        self.key = key  # (parent serial, token bytes)
        self.serial = serial  # this entry's identity for its children's keys (0 = the root)
        self.page = page
        self.refs = 0  # page tables holding this page


class BlockManager:
    def __init__(self, num_pages: int, layout: str = "paged", pages_per_slot: int = 0,
                 enable_prefix_cache: bool = False, first_page: int = 0, num_seats: int = 0,
                 max_blocks_per_seq: int = 0):
        """first_page: the id of this pool's first page (data-parallel attention numbers the pools
        of all ranks in one range, so a page id says its rank)."""
        if layout == "dense":
            if enable_prefix_cache:
                raise ValueError("the prefix cache needs the paged KV layout (dense slots are not shared)")
            if pages_per_slot < 1 or num_pages < pages_per_slot:
                raise ValueError(f"dense KV layout needs at least one slot of {pages_per_slot} pages, "
                                 f"the budget holds {num_pages}")
            num_pages -= num_pages % pages_per_slot
            first_slot = first_page // pages_per_slot
            self.free_slots: deque[int] = deque(range(first_slot, first_slot + num_pages // pages_per_slot))
        self.layout = layout
        self.pages_per_slot = pages_per_slot
        self.num_pages = num_pages
        self.free_pages: deque[int] = deque(range(first_page, first_page + num_pages))
        self.enable_prefix_cache = enable_prefix_cache
        self.cached: dict[tuple[int, bytes], CachedBlock] = {}
        self.page_entry: dict[int, CachedBlock] = {}  # page -> its cache entry (cached pages only)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, oldest first
        self._serials = itertools.count(1)
        self.num_queried_blocks = 0  # final blocks looked up at admission
        self.num_hit_blocks = 0  # of those, found in the cache
        self.num_evicted_pages = 0
        self.seat_pages = np.zeros((num_seats, max_blocks_per_seq), dtype=np.int64)
        self.seat_num_pages = np.zeros(num_seats, dtype=np.int64)

    def _mirror(self, request: Request, start: int = 0) -> None:
        """Copy the request's page table from index `start` on into its seat's row."""
        seat = request.slot
        if seat is None or not self.seat_pages.shape[0]:
            return
        table = request.page_table
        self.seat_pages[seat, start:len(table)] = table[start:]
        self.seat_num_pages[seat] = len(table)

    @property
    def num_free_pages(self) -> int:
        """Pages a request can get now: free, or cached but unreferenced (evicted on demand)."""
        if self.layout == "dense":
            return len(self.free_slots) * self.pages_per_slot
        return len(self.free_pages) + len(self.evictable)

    @property
    def num_cached_pages(self) -> int:
        """Pages holding a cached block, referenced or not."""
        return len(self.page_entry)

    def can_hold(self, request: Request) -> bool:
        """Could this request ever run (its whole canvas) with the cache empty?"""
        if self.layout == "dense":
            return request.num_blocks <= self.pages_per_slot
        return request.num_blocks <= self.num_pages

    # --- prefix cache ---
    def match(self, request: Request) -> list[CachedBlock]:
        """The cached entries of the request's longest run of leading final blocks (never its active
        block: that one is still being decoded, so the scheduler always runs it)."""
        if not self.enable_prefix_cache or request.page_table:
            return []
        hits, parent = [], 0
        for block in range(request.active_block):
            start, end = request.block_range(block)
            entry = self.cached.get((parent, request.tokens[start:end].tobytes()))
            if entry is None:
                break
            hits.append(entry)
            parent = entry.serial
        return hits

    def cache_blocks(self, request: Request, first: int, end: int) -> None:
        """Blocks [first, end) of the request are final and a forward has written their K/V: enter
        them in the cache. A block another request entered first (computed in the same forward)
        switches to the cached page and its own page is freed, so the chain stays whole."""
        if not self.enable_prefix_cache or first >= end:
            return
        tokens, bl = request.tokens, request.block_length
        parent = self._parent(request, first)
        for block in range(first, end):
            parent = self._enter(request, block, parent, tokens[block * bl:(block + 1) * bl].tobytes())

    def cache_rows(self, requests: list[Request], first: list[int], end: list[int], first_tokens: np.ndarray) -> None:
        """cache_blocks(requests[i], first[i], end[i]) for each row in order. first_tokens [R, bl]:
        each row's block first[i] (its final tokens), so the usual row, one block, costs no slicing
        of its own (one commit a row: a block commit step enters every running row's block)."""
        if not self.enable_prefix_cache:
            return
        data, width = first_tokens.tobytes(), first_tokens.shape[1] * first_tokens.itemsize
        for i, request in enumerate(requests):
            block = first[i]
            if end[i] - block == 1:
                self._enter(request, block, self._parent(request, block), data[i * width:(i + 1) * width])
            else:
                self.cache_blocks(request, block, end[i])

    def _parent(self, request: Request, block: int) -> int:
        """The serial of the cache entry the block hangs from (0: the root, for block 0)."""
        return self.page_entry[request.page_table[block - 1]].serial if block else 0

    def _enter(self, request: Request, block: int, parent: int, token_bytes: bytes) -> int:
        """Enter one final block under `parent`; returns its entry's serial (its children's parent)."""
        table = request.page_table
        key = (parent, token_bytes)
        entry = self.cached.get(key)
        if entry is None:
            entry = CachedBlock(key, next(self._serials), table[block])
            entry.refs = 1
            self.cached[key] = entry
            self.page_entry[entry.page] = entry
        elif entry.page != table[block]:
            self._ref(entry)
            self.free_pages.append(table[block])
            table[block] = entry.page
            if request.slot is not None and self.seat_pages.shape[0]:
                self.seat_pages[request.slot, block] = entry.page
        return entry.serial

    def _ref(self, entry: CachedBlock) -> None:
        if entry.refs == 0:
            del self.evictable[entry.page]
        entry.refs += 1

    def _take_page(self) -> int:
        if self.free_pages:
            return self.free_pages.popleft()
        page, _ = self.evictable.popitem(last=False)
        entry = self.page_entry.pop(page)
        del self.cached[entry.key]
        self.num_evicted_pages += 1
        return page

    # --- allocation ---
    def pages_missing(self, request: Request, num_blocks: int) -> int:
        if self.layout == "dense":
            return 0 if request.page_table else self.pages_per_slot
        return max(0, num_blocks - len(request.page_table))

    def can_allocate(self, request: Request, num_blocks: int, hits: list[CachedBlock] = ()) -> bool:
        """`hits` (from `match`, for a request being admitted) cover its first len(hits) blocks."""
        if self.layout == "dense":
            return bool(request.page_table) or bool(self.free_slots)
        taken_from_evictable = sum(1 for entry in hits if entry.refs == 0)
        return self.pages_missing(request, num_blocks) - len(hits) <= self.num_free_pages - taken_from_evictable

    def allocate(self, request: Request, num_blocks: int, hits: list[CachedBlock] = ()) -> None:
        """Make the request's page table cover its first `num_blocks` blocks, the hits' pages first."""
        if not self.can_allocate(request, num_blocks, hits):
            raise RuntimeError("allocate() without can_allocate()")
        if self.layout == "dense":
            if not request.page_table:
                slot = self.free_slots.popleft()
                request.page_table = list(range(slot * self.pages_per_slot, (slot + 1) * self.pages_per_slot))
                self._mirror(request)
            return
        if self.enable_prefix_cache and not request.page_table:
            self.num_queried_blocks += request.active_block
            self.num_hit_blocks += len(hits)
        start = len(request.page_table)
        for entry in hits:
            self._ref(entry)
            request.page_table.append(entry.page)
        while len(request.page_table) < num_blocks:
            request.page_table.append(self._take_page())
        self._mirror(request, start)

    def extend(self, requests: list[Request], num_blocks: list[int]) -> None:
        """Seated requests' tables grow to num_blocks[i] pages each, in order (the pages one
        allocate() per request would give); the caller has checked that the pages are there. A
        subclass with its own allocate rule (canvas_pages.py: sliding rings) gets its allocate."""
        if type(self).allocate is not BlockManager.allocate:
            for request, n in zip(requests, num_blocks):
                self.allocate(request, n)
            return
        have = [len(r.page_table) for r in requests]
        pages = self._take_pages(sum(num_blocks) - sum(have))
        at = 0
        for request, start, n in zip(requests, have, num_blocks):
            request.page_table.extend(pages[at:at + n - start])
            at += n - start
        if self.seat_pages.shape[0]:
            slots = np.array([r.slot for r in requests], dtype=np.int64)
            grown = np.array(num_blocks, dtype=np.int64) - have
            # each new page's (seat, column): the seat's rows from its old length on
            starts = np.repeat(np.cumsum(grown) - grown - np.array(have, dtype=np.int64), grown)
            self.seat_pages[np.repeat(slots, grown), np.arange(len(pages)) - starts] = pages
            self.seat_num_pages[slots] = num_blocks

    def _take_pages(self, n: int) -> list[int]:
        """n pages in the order n calls of _take_page give them (free ones first, then evictions)."""
        free = self.free_pages
        if n <= len(free):
            return [free.popleft() for _ in range(n)]
        return [self._take_page() for _ in range(n)]

    def free(self, request: Request) -> None:
        if self.layout == "dense":
            if request.page_table:
                self.free_slots.append(request.page_table[0] // self.pages_per_slot)
        else:
            # Last block first: a chain's deepest blocks are the oldest in the LRU, so eviction
            # takes leaves before the blocks they hang from.
            for page in reversed(request.page_table):
                entry = self.page_entry.get(page)
                if entry is None:
                    self.free_pages.append(page)
                    continue
                entry.refs -= 1
                if entry.refs == 0:
                    self.evictable[page] = None
        request.page_table = []
        request.num_cached_blocks = 0
        self._mirror(request)

    def check(self, requests: Iterable[Request]) -> None:
        """Raise if the accounting is off: every page free, cached-unreferenced or in use, exactly
        once; cache reference counts equal the page tables holding them; uncached pages have one
        holder."""
        if self.layout == "dense":
            return
        holders = Counter(page for request in requests for page in request.page_table)
        free, evictable, in_use = set(self.free_pages), set(self.evictable), set(holders)
        problems = []
        if len(free) != len(self.free_pages):
            problems.append("a page is twice in the free list")
        if free & evictable or free & in_use or evictable & in_use:
            problems.append(f"pages in two states: free&cached {sorted(free & evictable)}, "
                            f"free&used {sorted(free & in_use)}, cached-unreferenced&used {sorted(evictable & in_use)}")
        if len(free) + len(evictable) + len(in_use) != self.num_pages:
            problems.append(f"free {len(free)} + cached-unreferenced {len(evictable)} + in use {len(in_use)} "
                            f"!= total {self.num_pages}")
        for page, entry in self.page_entry.items():
            if entry.refs != holders.get(page, 0) or (entry.refs == 0) != (page in evictable):
                problems.append(f"page {page}: {entry.refs} refs, {holders.get(page, 0)} holders")
            if self.cached.get(entry.key) is not entry:
                problems.append(f"page {page}: its entry is not under its key")
        if len(self.cached) != len(self.page_entry):
            problems.append(f"{len(self.cached)} cache keys for {len(self.page_entry)} cached pages")
        shared = [page for page, n in holders.items() if n > 1 and page not in self.page_entry]
        if shared:
            problems.append(f"uncached pages held by several requests: {shared}")
        if problems:
            raise AssertionError("KV page accounting: " + "; ".join(problems))
