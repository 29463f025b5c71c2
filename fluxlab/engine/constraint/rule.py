"""The block-aware rule (docs/structured_output.md): one decode step of the constrained rows.

Grammar state advances only over the committed text and, within a step, over the active block's
decided positions in position order. For each constrained row:

1. before the decoder (`BlockGuard.__init__`, `mask_logits`): the matcher walks the block's decided
   prefix (from the first output position up to the first undecided one, `fixed`); the logits of that
   first undecided position get the grammar's mask, so its proposal, argmax or sampled, is valid;
2. the decoder runs unchanged on every row (its thresholds, counts and edits);
3. after it (`repair`): the matcher walks the new block from where it stood, in position order. A
   decided position is kept only if the grammar accepts it after everything left of it; the first
   one it refuses becomes undecided again (a mask), and positions right of it stay as the decoder
   left them, unchecked until the prefix reaches them. An edit inside the old prefix stands only if
   the walk over the edited block passes the old prefix and the first position's fill; otherwise the
   old prefix is put back whole. EOS stands only where the grammar may end; what follows it is not
   output and is not checked. A block is final only without masks, and also when the step left it
   as the forward read it (that forward's K/V is then over its final tokens).

A grammar that accepts every token the run writes changes nothing: no mask removes the argmax, no
walk refuses a token, so the tokens equal the unconstrained run's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from fluxlab.engine.constraint.matcher import Constraint, Walk
from fluxlab.engine.decoding.registry import DECODERS


@dataclass
class GuardedRow:
    row: int  # the decoding row
    constraint: Constraint
    lo: int  # first output position of the active block (after the prompt's tail)
    hi: int  # end of the output positions (block end, or max_new_tokens within the last block)
    before: np.ndarray  # [bl] the block the forward read
    fixed: int  # end of its valid decided prefix (the matcher has consumed before[lo:fixed])
    first_undecided: int  # the position whose logits get the mask (-1: none, the prefix ended otherwise)
    greedy: bool  # temperature 0 and a decoder that reads (argmax, probability) only: proposals from the masked logits
    edits: bool  # the decoder proposes on every output position, not only masks


class BlockGuard:
    """The constrained rows of one decode step: built before the proposals, `repair` after the decoder."""

    def __init__(self, requests: list, rows: np.ndarray, blocks: np.ndarray, mask_id: int):
        """rows: decoding-row indices of the constrained requests; blocks [len(rows), bl] their
        active blocks as the forward read them (host)."""
        self.mask_id = mask_id
        self.rows: list[GuardedRow] = []
        self.index = rows
        try:
            for i, r in enumerate(rows.tolist()):
                request = requests[r]
                constraint = request.constraint
                constraint.sync(request.output_ids)
                bl = blocks.shape[1]
                lo = request.prompt_positions_in_active_block()
                start = request.active_block * bl
                hi = max(lo, min(bl, request.num_prompt_tokens + request.params.max_new_tokens - start))
                fixed, why = constraint.walk(blocks[i], lo, hi, mask_id)
                decoder = DECODERS[request.params.decoder]
                self.rows.append(GuardedRow(r, constraint, lo, hi, blocks[i], fixed, fixed if why is Walk.MASK else -1,
                                            request.params.temperature == 0 and not decoder.needs_logits,
                                            decoder.edits))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Every matcher back at its committed output."""
        for guarded in self.rows:
            guarded.constraint.rewind()

    def mask_logits(self, logits: torch.Tensor, full_rows: np.ndarray) -> None:
        """logits [F, bl, V] of the full-logit rows `full_rows` (every constrained row is one): the
        grammar's mask on each row's first undecided position, in place."""
        vocab = logits.shape[-1]
        for guarded in self.rows:
            if guarded.first_undecided < 0:
                continue
            j = int(np.searchsorted(full_rows, guarded.row))
            allowed = guarded.constraint.allowed_tensor(vocab, logits.device)
            logits[j, guarded.first_undecided].masked_fill_(~allowed, -torch.inf)

    def greedy_proposals(self, tokens: torch.Tensor, conf: torch.Tensor, logits: torch.Tensor,
                         full_rows: np.ndarray, masked: torch.Tensor, editable: torch.Tensor) -> None:
        """Greedy constrained rows take full logits (for the mask), not the head's greedy statistics:
        their (argmax, probability) from the masked logits, where the head would have given them (masks,
        and every output position for an editing decoder), in place of tokens / conf [R, bl]."""
        from fluxlab.kernels.vocab_stats import greedy_stats

        for guarded in self.rows:
            if not guarded.greedy:
                continue
            r = guarded.row
            j = int(np.searchsorted(full_rows, r))
            top, prob = greedy_stats(logits[j])
            need = editable[r] & (masked[r] | guarded.edits)
            tokens[r] = torch.where(need, top, tokens[r])
            conf[r] = torch.where(need, prob, conf[r])

    def repair(self, after: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """after [len(rows), bl]: the decoder's blocks -> (the blocks the rule keeps, [len(rows)] bool:
        the block has no undecided output position left). Rewinds every matcher."""
        try:
            kept = after.copy()
            no_masks = np.zeros(len(self.rows), dtype=bool)
            for i, guarded in enumerate(self.rows):
                kept[i] = self._repair_row(guarded, kept[i])
                no_masks[i] = not (kept[i, guarded.lo:] == self.mask_id).any()
            return kept, no_masks
        finally:
            self.close()

    def _repair_row(self, guarded: GuardedRow, block: np.ndarray) -> np.ndarray:
        c, mask_id, before = guarded.constraint, self.mask_id, guarded.before
        lo, hi, fixed, first = guarded.lo, guarded.hi, guarded.fixed, guarded.first_undecided
        if np.array_equal(block[lo:fixed], before[lo:fixed]):
            end, why = c.walk(block, fixed, hi, mask_id)  # the matcher stands at `fixed` already
        else:  # an editing decoder changed the old prefix: the edits stand only if it stays valid
            reach = fixed + (first >= 0 and block[first] != mask_id)
            c.rewind()
            end, why = c.walk(block, lo, hi, mask_id)
            if why is Walk.REJECT and end < reach:
                block[lo:fixed] = before[lo:fixed]
                c.rewind()
                end, why = c.walk(block, lo, hi, mask_id)
        if why is Walk.REJECT:
            block[end] = mask_id
        return block


def apply_repair(guard: Optional[BlockGuard], result, decoder_ids: torch.Tensor) -> None:
    """The rule's answer written into a decode step's result (decoding/step.py DecodeResult), in place:
    the kept blocks, and for rows the rule changed, their fill / edit counts, the block-final bit and
    the state a decoder resets when its block is open again (levenshtein_joint's finalized bit)."""
    if guard is None or not guard.rows:
        return
    device = result.block.device
    index = torch.as_tensor(guard.index, device=device)
    after = result.block.index_select(0, index).cpu().numpy()
    kept, no_masks = guard.repair(after)
    before_host = np.stack([g.before for g in guard.rows])
    unchanged = (kept == before_host).all(axis=1)
    final = result.final.index_select(0, index).cpu().numpy()
    final = (final | unchanged) & no_masks
    result.block.index_copy_(0, index, torch.from_numpy(kept).to(device, result.block.dtype))
    result.final.index_copy_(0, index, torch.from_numpy(final).to(device))
    changed = ~(kept == after).all(axis=1)
    if changed.any():
        mask_id = guard.mask_id
        out = np.stack([np.arange(kept.shape[1]) >= g.lo for g in guard.rows])
        filled = ((before_host == mask_id) & (kept != mask_id) & out).sum(axis=1)
        edited = ((before_host != mask_id) & (kept != mask_id) & (kept != before_host) & out).sum(axis=1)
        filled_now = result.filled.index_select(0, index).cpu().numpy()
        edited_now = result.edited.index_select(0, index).cpu().numpy()
        result.filled.index_copy_(0, index, torch.from_numpy(np.where(changed, filled, filled_now)).to(
            device, result.filled.dtype))
        result.edited.index_copy_(0, index, torch.from_numpy(np.where(changed, edited, edited_now)).to(
            device, result.edited.dtype))
    names = list(DECODERS)
    ids = decoder_ids.index_select(0, index).cpu().tolist()
    for i, guarded in enumerate(guard.rows):
        if no_masks[i]:
            continue
        for key, value in DECODERS[names[ids[i]]].reopened_state.items():
            result.state[key][guarded.row] = value
