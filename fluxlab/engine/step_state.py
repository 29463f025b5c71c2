"""Per-seat decoding state on the device: one seat (slot) per running request.

Written when a request takes a seat (its knobs) or enters a block (prompt protection, decoder
state from the host mirror), never rebuilt from Python lists per step: a step gathers its rows'
seats, the decoders update them and the new values are scattered back in place.

Decoder state has three shapes (decoding/base.py): int counters [seat], int columns [seat, bl] and
a history log [seat, rows, bl] that grows by at most one row per forward (the tensor grows on
demand). The host mirrors all three (request.decoder_state / decoder_columns / decoder_log, from
the step's one device->host copy), so a seat is rebuilt exactly after preemption or a failed step.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from fluxlab.engine.decoding.registry import DECODERS, KNOBS, SAMPLING_KNOBS
from fluxlab.engine.sequence import Request

# The knobs a decode step reads, beyond those of the registry: derived once per request.
DERIVED_KNOBS = ("effective_steps",)


class StepState:
    def __init__(self, num_slots: int, device: torch.device, block_length: int = 1):
        self.device = device
        names = {k for d in DECODERS.values() for k in d.knobs} | set(SAMPLING_KNOBS)
        self.float_knobs = sorted(n for n in names if KNOBS[n].kind is float)
        self.int_knobs = sorted(n for n in names if KNOBS[n].kind is int) + list(DERIVED_KNOBS)
        self.state_names = sorted({s for d in DECODERS.values() for s in d.state})
        self.column_names = sorted({c for d in DECODERS.values() for c in d.columns})
        self.decoder_index = {name: i for i, name in enumerate(DECODERS)}
        self.floats = torch.zeros(num_slots, len(self.float_knobs), dtype=torch.float32, device=device)
        # int columns: knobs, then decoder id, prompt positions in the active block, decoder state
        self.ints = torch.zeros(num_slots, len(self.int_knobs) + 2 + len(self.state_names), dtype=torch.long,
                                device=device)
        self._decoder_col = len(self.int_knobs)
        self._prompt_col = self._decoder_col + 1
        self._state_col = self._prompt_col + 1
        self.columns = torch.zeros(num_slots, len(self.column_names), block_length, dtype=torch.long, device=device)
        self.history = torch.zeros(num_slots, 0, block_length, dtype=torch.long, device=device)
        # (request serial, active block) each seat was last written for; -1: never, or invalidated
        self.owner = np.full((num_slots, 2), -1, dtype=np.int64)

    def refresh(self, requests: list[Request], slots: np.ndarray, owners: np.ndarray) -> None:
        """Write the seats whose owner or block changed since their last write (admission, block
        entry, a preempted request back in a new seat); the others are already right. owners:
        [R, 2] each row's (request serial, active block), found without a loop over rows."""
        stale_rows = np.flatnonzero((self.owner[slots] != owners).any(axis=1))
        if not stale_rows.shape[0]:
            return
        stale = [requests[i] for i in stale_rows.tolist()]
        floats = np.array([[getattr(r.params, k) for k in self.float_knobs] for r in stale], dtype=np.float32)
        states = [r.decoder_state for r in stale]  # one read each: a seated request builds it from its seat
        ints = np.array([[getattr(r.params, k) for k in self.int_knobs]
                         + [self.decoder_index[r.params.decoder], r.prompt_positions_in_active_block()]
                         + [state.get(s, 0) for s in self.state_names] for r, state in zip(stale, states)],
                        dtype=np.int64)
        stale_slots = slots[stale_rows]
        seat_index = torch.from_numpy(stale_slots).to(self.device, non_blocking=True)
        self.floats.index_copy_(0, seat_index, torch.from_numpy(floats).to(self.device, non_blocking=True))
        self.ints.index_copy_(0, seat_index, torch.from_numpy(ints).to(self.device, non_blocking=True))
        if self.column_names:
            bl = self.columns.shape[2]
            columns = np.zeros((len(stale), len(self.column_names), bl), dtype=np.int64)
            for i, r in enumerate(stale):
                held = r.decoder_columns
                for j, name in enumerate(self.column_names):
                    if name in held:
                        columns[i, j] = held[name]
            self.columns.index_copy_(0, seat_index, torch.from_numpy(columns).to(self.device, non_blocking=True))
        for r in stale:
            # rows past a seat's log length are never read, so only logged rows need writing
            if r.decoder_log:
                self._reserve_history(len(r.decoder_log))
                self.history[r.slot, :len(r.decoder_log)] = torch.from_numpy(np.stack(r.decoder_log)).to(self.device)
        self.owner[stale_slots] = owners[stale_rows]

    def gather(self, slots: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor,
                                                  dict[str, torch.Tensor]]:
        """(knobs, decoder ids, prompt positions, decoder state) of the given seats, [R] each."""
        floats, ints = self.floats[slots], self.ints[slots]
        knobs = {k: floats[:, i] for i, k in enumerate(self.float_knobs)}
        knobs.update({k: ints[:, i] for i, k in enumerate(self.int_knobs)})
        state = {s: ints[:, self._state_col + i] for i, s in enumerate(self.state_names)}
        return knobs, ints[:, self._decoder_col], ints[:, self._prompt_col], state

    def gather_columns(self, slots: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
        """The given seats' columns of `names` (the batch's decoders'; the others are not read)."""
        if not names:
            return {}
        columns = self.columns[slots]
        return {name: columns[:, self.column_names.index(name)] for name in names}

    def gather_history(self, slots: torch.Tensor, rows: int) -> torch.Tensor:
        """[R, rows, bl]: the first `rows` history rows of the given seats; the step may append at
        any row below `rows`."""
        self._reserve_history(rows)
        return self.history[slots, :rows]

    def _reserve_history(self, rows: int) -> None:
        """Grow every seat's history to at least `rows` rows (doubling: a long block is rare, and
        most blocks end within a few dozen forwards)."""
        have = self.history.shape[1]
        if rows <= have:
            return
        grown = torch.zeros(self.history.shape[0], max(rows, 2 * have, 16), self.history.shape[2],
                            dtype=self.history.dtype, device=self.device)
        grown[:, :have] = self.history
        self.history = grown

    def store(self, slots: torch.Tensor, state: dict[str, torch.Tensor], columns: dict[str, torch.Tensor],
              log: Optional[torch.Tensor] = None, logged: Optional[torch.Tensor] = None,
              log_len: Optional[torch.Tensor] = None) -> None:
        """Scatter a step's new decoder state back; `log` rows are appended at `log_len` where `logged`."""
        if self.state_names:  # one scatter for every counter
            block = self.ints[:, self._state_col:self._state_col + len(self.state_names)]
            block.index_copy_(0, slots, torch.stack([state[n] for n in self.state_names], dim=1))
        for name, values in columns.items():
            self.columns[:, self.column_names.index(name)].index_copy_(0, slots, values)
        if log is not None:  # gather_history reserved a row at log_len for every row
            self.history[slots, log_len] = torch.where(logged[:, None], log, self.history[slots, log_len])
