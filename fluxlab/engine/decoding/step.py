"""One decode step for every decoding row of a forward, on the device, rows of several decoders mixed.

Each decoder present runs on the whole batch and its answer is kept for its own rows (mixed
batches are rare and [R, bl] work is tiny next to the forward).
"""
from __future__ import annotations

from dataclasses import dataclass

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


def decode(batch: DecodeBatch, decoder_ids: torch.Tensor, present: list[str]) -> DecodeResult:
    fill = torch.zeros_like(batch.masked)
    edit = torch.zeros_like(batch.masked)
    final = torch.zeros(batch.masked.shape[0], dtype=torch.bool, device=batch.masked.device)
    state = dict(batch.state)
    index = {name: i for i, name in enumerate(DECODERS)}
    outcomes = []
    for name in present:
        decoder = DECODERS[name]
        rows = (decoder_ids == index[name])[:, None]
        accepted = decoder.accept(batch)
        fill |= rows & accepted.fill
        edit |= rows & accepted.edit
        outcomes.append((decoder, rows, accepted))
    block = torch.where(fill | edit, batch.tokens, batch.block)
    masks_left = ((block == batch.mask_id) & batch.editable).sum(-1)
    for decoder, rows, accepted in outcomes:
        row_final, row_state = decoder.finish(batch, accepted, masks_left)
        final |= rows[:, 0] & row_final
        for name, value in row_state.items():
            state[name] = torch.where(rows[:, 0], value, state[name])
    return DecodeResult(block, fill.sum(-1), edit.sum(-1), final, state)
