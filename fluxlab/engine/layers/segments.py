"""A forward's query blocks as the attention backends plan them: one segment per query block.

A row of n query blocks from block f is n segments; segment f+i is block_length queries over its
request's pages 0 .. f+i (non-causal: the block-causal rule). The runner builds the arrays with
numpy from the seats' page-table mirror (seats.py), so no backend loops over rows; `of_rows` is
the same from (first_block, num_blocks, page_table) rows, for callers off the hot path (TP workers,
tests, the memory probe).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np


@dataclass
class Segments:
    """Never written after it is built: what is derived from it (slot mappings, padded copies, a
    backend's plan arrays) is kept in `memo` and reused while the runner reuses the segments
    (a batch of the same rows as the last, ScheduledBatch.same_rows)."""

    tables: np.ndarray  # [S, W] int: the page table of each segment's request (read up to windows[s])
    windows: np.ndarray  # [S] int: pages each segment attends to (its block + 1)
    row_segments: np.ndarray  # [R] int: consecutive segments of each row, in batch order
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """build(), once per key for these segments (its result must not be written either)."""
        value = self._memo.get(key)
        if value is None:
            value = self._memo[key] = build()
        return value

    @classmethod
    def of_rows(cls, rows: Sequence[tuple[int, int, Sequence[int]]]) -> "Segments":
        """From (first_block, num_blocks, page_table) rows (a table holds at least first + n pages)."""
        first = np.array([f for f, _, _ in rows], dtype=np.int64)
        counts = np.array([n for _, n, _ in rows], dtype=np.int64)
        row_windows = first + counts
        tables = np.zeros((len(rows), int(row_windows.max(initial=1))), dtype=np.int64)
        for r, ((_, _, table), window) in enumerate(zip(rows, row_windows.tolist())):
            tables[r, :window] = table[:window]
        ends = counts.cumsum()
        blocks = np.repeat(first - ends + counts, counts) + np.arange(int(ends[-1]) if len(rows) else 0)
        return cls(tables[np.repeat(np.arange(len(rows)), counts)], blocks + 1, counts)

    @classmethod
    def scratch(cls, count: int, page: int) -> "Segments":
        """`count` one-block rows on `page` (graph padding: they read and write only that page)."""
        return cls(np.full((count, 1), page, dtype=np.int64), np.ones(count, dtype=np.int64),
                   np.ones(count, dtype=np.int64))

    @property
    def num_segments(self) -> int:
        return self.windows.shape[0]

    @property
    def pages(self) -> np.ndarray:
        """[S] each segment's own page (its block's: where its K/V is written)."""
        return self.tables[np.arange(self.windows.shape[0]), self.windows - 1]

    def slot_mapping(self, block_length: int) -> np.ndarray:
        """[S * block_length] the cache slot of each query token: its segment's page, its offset."""
        return self.memo(("slots", block_length),
                         lambda: (self.pages[:, None] * block_length + np.arange(block_length)).ravel())

    def padded(self, count: int, page: int) -> "Segments":
        """These segments, then `count` scratch segments on `page`."""
        if not count:
            return self
        return self.memo(("padded", count, page), lambda: self._padded(count, page))

    def _padded(self, count: int, page: int) -> "Segments":
        tables = np.full((self.num_segments + count, self.tables.shape[1]), page, dtype=self.tables.dtype)
        tables[:self.num_segments] = self.tables
        return Segments(tables, np.concatenate([self.windows, np.ones(count, dtype=self.windows.dtype)]),
                        np.concatenate([self.row_segments, np.ones(count, dtype=self.row_segments.dtype)]))

    def rows_range(self, start: int, stop: int) -> "Segments":
        """The segments of rows start .. stop - 1."""
        ends = self.row_segments.cumsum()
        begin, end = int(ends[start - 1]) if start else 0, int(ends[stop - 1]) if stop else 0
        return Segments(self.tables[begin:end], self.windows[begin:end], self.row_segments[start:stop])

    def row_view(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first_block [R], window [R] = first + n, page table [R, W]) per row."""
        last = self.row_segments.cumsum() - 1
        window = self.windows[last]
        return window - self.row_segments, window, self.tables[last]
