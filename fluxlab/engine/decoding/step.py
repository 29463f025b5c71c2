"""One decode step for every decoding row of a forward, on the device, rows of several decoders mixed.

Each decoder present runs on the whole batch and its answer is kept for its own rows (mixed
batches are rare and [R, bl] work is tiny next to the forward). Every row belongs to a present
decoder, so each row's answer is its own decoder's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from fluxlab.engine.decoding.registry import DECODERS
from fluxlab.engine.decoding.base import DecodeBatch


@dataclass
class DecodeResult:
    block: torch.Tensor  # [R, bl] the block after this step
    filled: torch.Tensor  # [R]
    edited: torch.Tensor  # [R]
    final: torch.Tensor  # [R] bool
    state: dict[str, torch.Tensor]  # [R] each, every registered state name
    columns: dict[str, torch.Tensor]  # [R, bl] each, every registered column name
    log: Optional[torch.Tensor]  # [R, bl] rows appended to the history where `logged` (None: no decoder logs)
    logged: Optional[torch.Tensor]  # [R] bool


def decode(batch: DecodeBatch, decoder_ids: torch.Tensor, present: list[str]) -> DecodeResult:
    index = {name: i for i, name in enumerate(DECODERS)}
    result = None
    for name in present:
        step = DECODERS[name].step(batch)
        if result is None:  # the first decoder's answer stands for every row until another's replaces it
            result = DecodeResult(step.block, step.filled, step.edited, step.final, dict(batch.state),
                                  dict(batch.columns), None, None)
        rows = decoder_ids == index[name]
        result.block = torch.where(rows[:, None], step.block, result.block)
        result.filled = torch.where(rows, step.filled, result.filled)
        result.edited = torch.where(rows, step.edited, result.edited)
        result.final = torch.where(rows, step.final, result.final)
        for key, value in step.state.items():
            result.state[key] = torch.where(rows, value, result.state[key])
        for key, value in step.columns.items():
            result.columns[key] = torch.where(rows[:, None], value, result.columns[key])
        if step.log is not None:
            if result.log is None:
                result.log, result.logged = torch.zeros_like(batch.block), torch.zeros_like(rows)
            result.log = torch.where(rows[:, None], step.log, result.log)
            result.logged = torch.where(rows, step.logged, result.logged)
    return result
