"""The decoder protocol: what one forward's proposals become, for the rows one decoder owns.

A decoder is one module: the knobs it reads (ranges in knobs.py), its per-row state, its device
accept step and its block-final rule. The engine's decode step (decoding/step.py) gathers every
row's view, runs each decoder present in the batch on all rows and keeps its answer for its rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch

from fluxlab.engine.decoding.sampling import filtered_probs


@dataclass
class DecodeBatch:
    """One forward's view of its decoding rows, every tensor on the device, [R, bl] unless noted."""

    tokens: torch.Tensor  # proposals (argmax, or sampled for temperature > 0)
    conf: torch.Tensor  # confidence of each proposal (probability of that token)
    block: torch.Tensor  # the active block as the forward read it
    masked: torch.Tensor  # mask positions the decoder may fill (prompt positions excluded)
    editable: torch.Tensor  # non-prompt positions
    knobs: dict[str, torch.Tensor]  # [R] per-row knob values (float32 / int64)
    state: dict[str, torch.Tensor]  # [R] per-row decoder state, zero on block entry
    mask_id: int
    columns: dict[str, torch.Tensor] = field(default_factory=dict)  # [R, bl] per-position state, zero on entry
    history: Optional[torch.Tensor] = None  # [R, n, bl] rows logged in this block, oldest first (n >= 1)
    history_len: Optional[torch.Tensor] = None  # [R] rows of `history` each row has logged
    logits: Optional[torch.Tensor] = None  # [F, bl, V] full-vocabulary logits of rows `logit_rows`
    logit_rows: Optional[torch.Tensor] = None  # [F] the rows (needs_logits decoders, sampled rows)
    special: dict[str, int] = field(default_factory=dict)  # the checkpoint's extra token ids (delete_id, ...)


@dataclass
class Accepted:
    fill: torch.Tensor  # [R, bl] mask -> proposal
    edit: torch.Tensor  # [R, bl] token -> proposal (editing decoders)


@dataclass
class DecoderStep:
    """A decoder's answer for every row of the batch (the caller keeps its own rows'): the block
    after this forward, how many masks it filled and tokens it edited, whether the block is final,
    and the decoder's new per-row state."""

    block: torch.Tensor  # [R, bl]
    filled: torch.Tensor  # [R]
    edited: torch.Tensor  # [R]
    final: torch.Tensor  # [R] bool
    state: dict[str, torch.Tensor]
    columns: dict[str, torch.Tensor] = field(default_factory=dict)  # [R, bl] each
    log: Optional[torch.Tensor] = None  # [R, bl] the row each row appends to its history
    logged: Optional[torch.Tensor] = None  # [R] bool: whether it appends


class Decoder:
    """Subclass per decoder; instances are stateless (row state lives in DecodeBatch.state)."""

    name: ClassVar[str]
    knobs: ClassVar[tuple[str, ...]]  # beyond the sampling knobs every decoder reads
    edits: ClassVar[bool] = False  # rewrites non-mask positions: logits needed on all non-prompt positions
    state: ClassVar[tuple[str, ...]] = ()  # int64 per-row counters, reset when a block is entered
    # Richer per-row state, also zero at block entry and mirrored on the host (request.decoder_columns /
    # decoder_log) so a seat is rebuilt exactly after preemption or a failed step:
    columns: ClassVar[tuple[str, ...]] = ()  # int64 [bl] per-position values
    logs: ClassVar[bool] = False  # appends one [bl] row per forward to its row's history (DecoderStep.log)
    needs_logits: ClassVar[bool] = False  # reads full-vocabulary logits of its rows' blocks (DecodeBatch.logits)
    greedy_only: ClassVar[bool] = False  # temperature > 0 is refused
    special_ids: ClassVar[tuple[str, ...]] = ()  # checkpoint token ids it needs (SpecialIds field names)
    # State values that open a block again: a grammar constraint (engine/constraint/rule.py) that takes
    # a token back leaves masks in a block this decoder may have called done.
    reopened_state: ClassVar[dict[str, int]] = {}

    def propose(self, logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """A sampled row's proposals (temperature > 0): logits [bl, V] -> (tokens [bl], confidence [bl]).
        The default draws once per position from the filtered distribution (sampling.py), confidence the
        drawn token's probability there; a decoder of a published routine that samples otherwise (its
        own arithmetic, other draws from the request's generator) overrides it."""
        probs = filtered_probs(logits, temperature, top_k, top_p)
        sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        return sampled, probs.gather(-1, sampled[:, None]).squeeze(-1)

    def step(self, batch: DecodeBatch) -> DecoderStep:
        """The whole rule for one forward. The default is accept (which masks to fill, which tokens
        to edit), apply, then the block-final rule; a decoder that moves tokens (levenshtein_joint's
        DELETE/SPLIT) overrides step itself."""
        accepted = self.accept(batch)
        block = torch.where(accepted.fill | accepted.edit, batch.tokens, batch.block)
        masks_left = ((block == batch.mask_id) & batch.editable).sum(-1)
        final, state = self.finish(batch, accepted, masks_left)
        return DecoderStep(block, accepted.fill.sum(-1), accepted.edit.sum(-1), final, state)

    def accept(self, batch: DecodeBatch) -> Accepted:
        """Which masks to fill and which tokens to edit (decoders that keep the default `step`)."""
        raise TypeError(f"decoder {self.name!r} neither overrides step() nor implements accept()")

    def finish(self, batch: DecodeBatch, accepted: Accepted, masks_left: torch.Tensor
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(final [R] bool, new state): the block-final rule, after `accepted` is applied."""
        raise TypeError(f"decoder {self.name!r} neither overrides step() nor implements finish()")


def most_confident(score: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """[R, bl] bool: the single most confident masked position of each row (the first on ties)."""
    return torch.zeros_like(masked).scatter(1, score.argmax(dim=-1, keepdim=True), True) & masked


def masked_scores(batch: DecodeBatch) -> torch.Tensor:
    return torch.where(batch.masked, batch.conf, torch.full_like(batch.conf, -torch.inf))
