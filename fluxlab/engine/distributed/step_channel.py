"""Rank 0 -> TP worker step channel: a per-step difference in shared memory, a doorbell on a pipe.

A worker keeps, for every seat (request.slot), the page table and the canvas tokens it was last
sent; a step's message carries only what changed since then (vLLM's per-step difference):
- seats whose owner changed (a request took the seat): their table and tokens start over;
- page-table edits: (seat, first changed index, the pages from there on), usually one appended page;
- the rows: (seat, first_block, num_blocks, decodes); positions follow from them (a row is whole
  blocks at their own positions), so they are never sent;
- tokens that differ from the worker's copy, as (index, token) pairs: a decode step sends the few
  positions the decoder filled, not the whole block (a new block's masks are already there, since
  both sides start a seat's canvas as mask ids);
- the greedy logit positions as a bitmask over the step's tokens (they ascend), the others as ids;
- `extra`: a few ints a caller adds (data-parallel attention: every rank's token count).

The bytes go into one of two regions of a memfd (shared memory without a name: nothing in
/dev/shm to unlink, nothing left behind if a process is killed, no resource tracker), alternating
per step; the doorbell (region, length) is 8 bytes on the worker's step pipe. The pipe, not a
semaphore, is the event: a worker blocked on it sees EOF when rank 0 dies, and rank 0 writing to
a dead worker gets BrokenPipeError at once; a semaphore wait would hang in both cases.
Reuse of a region is safe: rank 0 writes step k + 2 after step k + 1's forward, whose collectives
every worker joins only after decoding step k + 1, long after it finished reading step k.
"""
from __future__ import annotations

import mmap
import os
import struct
from typing import Optional, Sequence

import numpy as np

from fluxlab.engine.runner_inputs import StepInputs

_DOORBELL = struct.Struct("<ii")  # (region, message bytes); region -1: shut down
_HEADER = struct.Struct("<10i")
_GREEDY_BITMASK, _GREEDY_IDS = 0, 1


def channel_capacity(num_seats: int, pages_per_seq: int, max_tokens: int, max_extra: int = 64) -> int:
    """Bytes of one region: the largest message a step of these limits can make."""
    rows = 2 * num_seats  # seats, and as many rows without a seat (direct forwards in tests)
    words = rows * (1 + 3 + 3 + pages_per_seq) + 2 * max_tokens + 2 * max_tokens + max_extra
    return _HEADER.size + 4 * words + 64


def _first_difference(table: Sequence[int], known: list[int]) -> int:
    """Where a page table stops matching the workers' copy (usually: its end, one page appended)."""
    if len(table) >= len(known) and table[:len(known)] == known:
        return len(known)
    for k, (page, had) in enumerate(zip(table, known)):
        if page != had:
            return k
    return min(len(table), len(known))


class _Packer:
    def __init__(self, view: memoryview):
        self.view, self.at = view, 0

    def put(self, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        end = self.at + data.shape[0]
        if end > len(self.view):
            raise ValueError(f"a step message of more than {len(self.view)} bytes does not fit the TP step channel")
        np.frombuffer(self.view, dtype=np.uint8, count=data.shape[0], offset=self.at)[:] = data
        self.at = (end + 3) & ~3  # int32 alignment for the next section


class _Unpacker:
    def __init__(self, view: memoryview, at: int):
        self.view, self.at = view, at

    def take(self, dtype, count: int) -> np.ndarray:
        out = np.frombuffer(self.view, dtype=dtype, count=count, offset=self.at).copy()
        self.at = (self.at + out.nbytes + 3) & ~3
        return out


class _SeatCopies:
    """Page tables and canvas tokens per seat, as the worker holds them (both sides keep one)."""

    def __init__(self, num_seats: int, pages_per_seq: int, block_length: int, mask_id: int):
        self.num_seats = num_seats
        self.mask_id = mask_id
        self.block_length = block_length
        self.canvas = pages_per_seq * block_length
        total = 2 * num_seats  # seats, then one per row without a seat
        self.tokens = np.full((total, self.canvas), mask_id, dtype=np.int32)
        self.flat_tokens = self.tokens.reshape(-1)

    def reset_tokens(self, seats: Sequence[int]) -> None:
        if len(seats):
            self.tokens[np.asarray(seats)] = self.mask_id

    def token_index(self, seats: np.ndarray, lengths: np.ndarray, positions: np.ndarray) -> np.ndarray:
        if positions.shape[0] and int(positions.max()) >= self.canvas:
            raise ValueError(f"position {int(positions.max())} is past the TP step channel's canvas of {self.canvas}")
        return np.repeat(seats.astype(np.int64) * self.canvas, lengths) + positions


class StepWriter:
    """Rank 0's half: encodes each step for the workers that ring on `pipes` (all of them under TP)."""

    def __init__(self, num_seats: int, pages_per_seq: int, block_length: int, max_tokens: int, mask_id: int):
        self.capacity = channel_capacity(num_seats, pages_per_seq, max_tokens)
        self.fd = os.memfd_create("fluxlab-tp-steps")
        os.ftruncate(self.fd, 2 * self.capacity)
        self._map = mmap.mmap(self.fd, 2 * self.capacity)
        self._regions = [memoryview(self._map)[i * self.capacity:(i + 1) * self.capacity] for i in range(2)]
        self.copies = _SeatCopies(num_seats, pages_per_seq, block_length, mask_id)
        self.owner: list[Optional[int]] = [None] * num_seats  # request serial per seat, as the workers know it
        self.tables: list[list[int]] = [[] for _ in range(2 * num_seats)]
        self.pipes: list = []
        self.num_steps = 0
        self.bytes_sent = 0  # over all pipes, doorbells included

    def setup(self) -> dict:
        """What a worker needs to attach (its fd travels separately, through pass_fds)."""
        c = self.copies
        return {"capacity": self.capacity, "num_seats": c.num_seats, "pages_per_seq": c.canvas // c.block_length,
                "block_length": c.block_length, "mask_id": c.mask_id}

    def send(self, inputs: StepInputs, extra: Sequence[int] = ()) -> None:
        region = self.num_steps % 2
        nbytes = self._encode(inputs, extra, self._regions[region])
        self.num_steps += 1
        bell = _DOORBELL.pack(region, nbytes)
        for pipe in self.pipes:
            pipe.send_bytes(bell)  # BrokenPipeError if that worker is gone
        self.bytes_sent += len(self.pipes) * (nbytes + len(bell) + 4)  # + the Connection's length prefix

    def send_shutdown(self) -> None:
        for pipe in self.pipes:
            pipe.send_bytes(_DOORBELL.pack(-1, 0))

    def close(self) -> None:
        if self._map.closed:
            return
        for view in self._regions:
            view.release()
        self._map.close()
        os.close(self.fd)

    def _encode(self, inputs: StepInputs, extra: Sequence[int], region: memoryview) -> int:
        copies, bl = self.copies, self.copies.block_length
        rows = inputs.rows
        resets, table_words, row_words, seats = [], [], [], []
        for i, (first, n, decodes, table) in enumerate(rows):
            if inputs.seats is None:  # a row of no seat: sent whole, in a spare seat
                seat = copies.num_seats + i
                resets.append(seat)
                self.tables[seat] = []
            else:
                seat, serial = inputs.seats[i]
                if self.owner[seat] != serial:
                    self.owner[seat] = serial
                    resets.append(seat)
                    self.tables[seat] = []
            known = self.tables[seat]
            if table != known:
                start = _first_difference(table, known)
                table_words += [seat, start, len(table) - start, *table[start:]]
                self.tables[seat] = list(table)
            seats.append(seat)
            row_words += [seat, first, 2 * n + int(decodes)]
        copies.reset_tokens(resets)
        seat_arr = np.asarray(seats, dtype=np.int64)
        lengths = np.asarray([n * bl for _, n, _, _ in rows], dtype=np.int64)
        flat = copies.token_index(seat_arr, lengths, np.asarray(inputs.positions, dtype=np.int64))
        tokens = np.asarray(inputs.token_ids).astype(np.int32, copy=False)
        changed = np.flatnonzero(copies.flat_tokens[flat] != tokens).astype(np.int32)
        values = tokens[changed]
        copies.flat_tokens[flat[changed]] = values
        num_tokens = tokens.shape[0]
        greedy = np.asarray(inputs.logit_index[:inputs.num_greedy], dtype=np.int64)
        if greedy.shape[0] == 0 or (np.all(np.diff(greedy) > 0) and greedy[0] >= 0 and greedy[-1] < num_tokens):
            mode = _GREEDY_BITMASK
            bits = np.zeros(num_tokens, dtype=bool)
            bits[greedy] = True
            greedy_section = np.packbits(bits)
        else:
            mode, greedy_section = _GREEDY_IDS, greedy.astype(np.int32)
        others = np.asarray(inputs.logit_index[inputs.num_greedy:], dtype=np.int32)
        packer = _Packer(region)
        packer.put(np.frombuffer(_HEADER.pack(len(rows), num_tokens, len(resets), len(table_words), changed.shape[0],
                                              inputs.num_greedy, mode, greedy_section.shape[0], others.shape[0],
                                              len(extra)), dtype=np.uint8))
        for section in (resets, row_words, table_words, changed, values, greedy_section, others, list(extra)):
            packer.put(np.asarray(section, dtype=np.int32) if isinstance(section, list) else section)
        return packer.at


class StepReader:
    """A worker's half: `receive()` blocks for the next step; None means shut down."""

    def __init__(self, fd: int, pipe, capacity: int, num_seats: int, pages_per_seq: int, block_length: int,
                 mask_id: int, page_offset: int = 0):
        self.pipe = pipe
        self._map = mmap.mmap(fd, 2 * capacity)
        os.close(fd)
        self._regions = [memoryview(self._map)[i * capacity:(i + 1) * capacity] for i in range(2)]
        self.copies = _SeatCopies(num_seats, pages_per_seq, block_length, mask_id)
        self.tables = np.zeros((2 * num_seats, pages_per_seq), dtype=np.int64)
        self.table_len = np.zeros(2 * num_seats, dtype=np.int64)
        self.page_offset = page_offset  # data-parallel attention: this rank's first page in rank 0's numbering

    def receive(self) -> Optional[tuple[StepInputs, list[int]]]:
        """(the step's inputs, its extra ints), or None at shutdown. EOFError if rank 0 is gone."""
        region, nbytes = _DOORBELL.unpack(self.pipe.recv_bytes())
        if region < 0:
            return None
        view = self._regions[region]
        (num_rows, num_tokens, num_resets, num_table_words, num_changed, num_greedy, mode, greedy_len,
         num_others, num_extra) = _HEADER.unpack_from(view, 0)
        un = _Unpacker(view, _HEADER.size)
        resets = un.take(np.int32, num_resets)
        row_words = un.take(np.int32, 3 * num_rows).reshape(num_rows, 3).astype(np.int64)
        table_words = un.take(np.int32, num_table_words).tolist()
        changed = un.take(np.int32, num_changed)
        values = un.take(np.int32, num_changed)
        greedy_section = un.take(np.uint8 if mode == _GREEDY_BITMASK else np.int32, greedy_len)
        others = un.take(np.int32, num_others)
        extra = un.take(np.int32, num_extra).tolist()
        copies, bl = self.copies, self.copies.block_length
        copies.reset_tokens(resets)
        self.table_len[resets] = 0
        at = 0
        while at < len(table_words):
            seat, start, count = table_words[at:at + 3]
            self.tables[seat, start:start + count] = np.asarray(table_words[at + 3:at + 3 + count]) - self.page_offset
            self.table_len[seat] = start + count
            at += 3 + count
        seats, firsts, packed = row_words[:, 0], row_words[:, 1], row_words[:, 2]
        counts, decodes = packed // 2, packed % 2 == 1
        lengths = counts * bl
        offsets = np.cumsum(lengths) - lengths
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(offsets - firsts * bl, lengths)
        flat = copies.token_index(seats, lengths, positions)
        copies.flat_tokens[flat[changed]] = values
        token_ids = copies.flat_tokens[flat].astype(np.int64)
        if mode == _GREEDY_BITMASK:
            greedy = np.flatnonzero(np.unpackbits(greedy_section, count=num_tokens))
        else:
            greedy = greedy_section.astype(np.int64)
        logit_index = np.concatenate([greedy, others.astype(np.int64)])
        rows = [(int(f), int(n), bool(d), self.tables[s, :self.table_len[s]])
                for s, f, n, d in zip(seats.tolist(), firsts.tolist(), counts.tolist(), decodes.tolist())]
        return StepInputs(token_ids, positions, rows, logit_index, num_greedy), extra

    def close(self) -> None:
        for view in self._regions:
            view.release()
        self._map.close()
