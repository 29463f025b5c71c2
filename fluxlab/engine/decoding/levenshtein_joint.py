"""LLaDA2.2 levenshtein_joint (DESIGN §5): joint mask->token / token->token writes, then the
DELETE/SPLIT edit scan, vectorised over rows of [R, block_length] on the device.

Per row the decoder keeps `LevenshteinState` (original-mask bitmap that moves with edits, N, t,
post steps, finalized, the written blocks seen in this block). `levenshtein_step` applies the
seven numbered rules of DESIGN §5 to one forward's logits and updates the state in place; it has no
host sync and no per-token Python loop, so it can sit inside a CUDA graph. fluxlab/engine/
reference_llada22.py is the same rules written one position at a time.

Choices where the rules leave room (the reference makes the same ones):
- candidates are argmax over the vocabulary without the mask id (lowest id on ties); confidence
  is that token's probability under the fp32 softmax without the mask logit;
- on a final round the candidate is the best token that is neither mask, DELETE nor SPLIT, with
  its own probability under the same softmax;
- "need most confident masks" breaks ties by position (stable sort);
- anti-loop: the least confident changed position (lowest position on ties) takes its next-best
  token (excluding mask and the tokens tried), up to ESCAPE_RETRIES times until the written block
  is new; after the last retry it keeps the last try. The written block (after escape, before the
  scan) is what the history records;
- a forward whose input block has no masks and which changes nothing ends the block (the input
  was the final tokens, so its K/V can be committed); a finalized row's forward is such a forward.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from fluxlab.engine.decoding.base import DecodeBatch, Decoder, DecoderStep

ESCAPE_RETRIES = 5


@dataclass
class LevenshteinState:
    """Per-row state; row r of every tensor belongs to the same request. H = history capacity."""

    orig_mask: torch.Tensor    # [R, L] bool: position holds (or held) a mask present at block entry
    num_initial: torch.Tensor  # [R] int64: N, original masks at block entry
    step: torch.Tensor         # [R] int64: t, forwards applied in this block
    post_steps: torch.Tensor   # [R] int64: forwards since the last original mask was resolved
    finalized: torch.Tensor    # [R] bool: a final round ran; the next forward changes nothing
    history: torch.Tensor      # [R, H, L] int64: written blocks of this block (exact sequences)
    history_len: torch.Tensor  # [R] int64: entries written (ring index history_len % H)

    @classmethod
    def empty(cls, num_rows: int, block_length: int, history: int, device=None) -> "LevenshteinState":
        """All rows finalized (inert) until `enter_block` resets them. history >= the largest
        max_steps_per_block keeps every written block of a block (no ring wrap)."""
        z = torch.zeros(num_rows, dtype=torch.long, device=device)
        return cls(torch.zeros(num_rows, block_length, dtype=torch.bool, device=device), z.clone(), z.clone(),
                   z.clone(), torch.ones(num_rows, dtype=torch.bool, device=device),
                   torch.zeros(num_rows, history, block_length, dtype=torch.long, device=device), z.clone())

    def select(self, rows: torch.Tensor) -> "LevenshteinState":
        """A copy of some rows (e.g. the batch's slots of a persistent per-slot state)."""
        return LevenshteinState(*(getattr(self, f.name)[rows] for f in fields(self)))

    def assign(self, rows: torch.Tensor, other: "LevenshteinState") -> None:
        """Write `other`'s rows back into rows `rows` of this state."""
        for f in fields(self):
            getattr(self, f.name)[rows] = getattr(other, f.name)

    def enter_block(self, rows: torch.Tensor, block: torch.Tensor, prompt_len: torch.Tensor, mask_id: int) -> None:
        """Reset rows `rows` for a new active block: block [n, L] as entered (prompt tail + masks, or
        all masks), prompt_len [n] prompt positions at its start (never decoded)."""
        editable = torch.arange(block.shape[1], device=block.device)[None, :] >= prompt_len[:, None]
        orig = (block == mask_id) & editable
        self.orig_mask[rows] = orig
        self.num_initial[rows] = orig.sum(-1)
        for name in ("step", "post_steps", "history_len"):
            getattr(self, name)[rows] = 0
        self.finalized[rows] = False


@dataclass
class LevenshteinKnobs:
    """Per-row decoding parameters, [R] tensors."""

    threshold: torch.Tensor          # float32
    editing_threshold: torch.Tensor  # float32
    steps: torch.Tensor              # int64, >= 1
    max_post_steps: torch.Tensor     # int64, >= 0
    max_steps_per_block: torch.Tensor  # int64, >= 2


@dataclass
class LevenshteinStepOutput:
    block: torch.Tensor        # [R, L] the block after this forward (exactly L tokens)
    num_filled: torch.Tensor   # [R] masks written (mask -> token, DELETE/SPLIT included)
    num_edited: torch.Tensor   # [R] token -> token writes
    final_round: torch.Tensor  # [R] bool: this forward was a final round (row now finalized)
    block_final: torch.Tensor  # [R] bool: this forward's input was the block's final tokens
    escaped: torch.Tensor      # [R] bool: the anti-loop moved a position
    written: torch.Tensor      # [R, L] the written block (after escape, before the scan): what history records


def argmax_excluding(logits: torch.Tensor, excluded: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(max value, argmax) over the last dim without the `excluded` ids, lowest id on ties, from
    views of the vocabulary slices between them (no copy of the logits)."""
    cuts = sorted(set(excluded))
    best_val = best_idx = None
    lo = 0
    for hi in cuts + [logits.shape[-1]]:
        if hi > lo:
            val, idx = logits[..., lo:hi].max(dim=-1)
            idx = idx + lo
            if best_val is None:
                best_val, best_idx = val, idx
            else:  # strictly greater: a tie keeps the earlier (lower-id) slice
                better = val > best_val
                best_val, best_idx = torch.where(better, val, best_val), torch.where(better, idx, best_idx)
        lo = hi + 1
    return best_val, best_idx


def logsumexp_excluding(logits: torch.Tensor, excluded: int) -> torch.Tensor:
    """log-sum-exp over the last dim without one id (the mask), from two views."""
    parts = [p for p in (logits[..., :excluded], logits[..., excluded + 1:]) if p.shape[-1]]
    return torch.logsumexp(torch.stack([torch.logsumexp(p, dim=-1) for p in parts], dim=-1), dim=-1)


def stable_top_k(score: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Boolean [R, L]: the k[r] highest scores of row r, earlier positions first on ties."""
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(score.shape[1], device=score.device)
                                            .expand_as(order).contiguous())
    return rank < k[:, None]


def edit_scan(written: torch.Tensor, before: torch.Tensor, orig_mask: torch.Tensor, editable: torch.Tensor, *,
              mask_id: int, delete_id: int, split_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule 6 over [R, L]: a generated DELETE vanishes, a generated SPLIT becomes [new mask, the
    token `before` held there]; prompt positions and other tokens stay. Truncated to L or padded
    with new masks. -> (block [R, L], orig_mask [R, L]).

    Each position contributes 0, 1 or 2 tokens; an exclusive cumsum gives where they land and
    one scatter per contribution places them; destinations past L go to a sink column."""
    R, L = written.shape
    is_delete = editable & (written == delete_id)
    is_split = editable & (written == split_id)
    count = torch.where(is_delete, 0, torch.where(is_split, 2, 1))
    dest = torch.cumsum(count, dim=1) - count
    sink = torch.full_like(dest, L)
    tokens = torch.full((R, L + 1), mask_id, dtype=written.dtype, device=written.device)
    orig = torch.zeros(R, L + 1, dtype=torch.bool, device=written.device)
    first = torch.where((count > 0) & (dest < L), dest, sink)
    tokens.scatter_(1, first, torch.where(is_split, torch.full_like(written, mask_id), written))
    orig.scatter_(1, first, orig_mask & ~is_split)
    second = torch.where(is_split & (dest + 1 < L), dest + 1, sink)
    tokens.scatter_(1, second, before)
    orig.scatter_(1, second, orig_mask)
    return tokens[:, :L], orig[:, :L]


@torch.no_grad()
def levenshtein_step(logits: torch.Tensor, block: torch.Tensor, prompt_len: torch.Tensor, state: LevenshteinState,
                     knobs: LevenshteinKnobs, *, mask_id: int, delete_id: int, split_id: int,
                     escape_retries: int = ESCAPE_RETRIES) -> LevenshteinStepOutput:
    """One forward of levenshtein_joint for R rows: logits [R, L, V] of each row's active block,
    block [R, L] the forward's input tokens, prompt_len [R] prompt positions at the block's start.
    Updates `state` in place (finalized rows are left unchanged) and returns the new blocks."""
    R, L, _ = logits.shape
    device = block.device
    logits = logits.float()
    positions = torch.arange(L, device=device)
    editable = positions[None, :] >= prompt_len[:, None]
    active = ~state.finalized
    masked = (block == mask_id) & editable
    unresolved = masked & state.orig_mask
    num_masks, num_unresolved = masked.sum(-1), unresolved.sum(-1)

    # Candidates: argmax without the mask id; on final rounds also without DELETE/SPLIT.
    lse = logsumexp_excluding(logits, mask_id)
    top_val, top_tok = argmax_excluding(logits, [mask_id])
    alt_val, alt_tok = argmax_excluding(logits, [mask_id, delete_id, split_id])
    conf, alt_conf = torch.exp(top_val - lse), torch.exp(alt_val - lse)

    # 1. post steps
    post = torch.where(num_unresolved > 0, 0, state.post_steps + 1)
    # 3. (before 2, which needs it when max_post_steps == 0) the scheduled mask->token choice
    t, n, steps = state.step, state.num_initial, knobs.steps
    need = n // steps + (t < n % steps).long() + (num_masks - num_unresolved)
    score = torch.where(masked, conf, -torch.inf)
    high = score > knobs.threshold[:, None]
    enough = high.sum(-1) >= need
    top_need = stable_top_k(score, torch.minimum(need, num_masks)) & masked
    fill = torch.where((t < steps)[:, None], torch.where(enough[:, None], high, top_need), masked)
    # 2. final round
    resolves_all = ~(unresolved & ~fill).any(-1)
    max_post = knobs.max_post_steps
    final = active & (((max_post > 0) & (post >= max_post)) | ((max_post == 0) & resolves_all)
                      | (t >= knobs.max_steps_per_block - 1))
    fill = torch.where(final[:, None], masked, fill) & active[:, None]
    cand = torch.where(final[:, None], alt_tok, top_tok)
    cand_conf = torch.where(final[:, None], alt_conf, conf)
    # 4. token -> token
    edit = active[:, None] & editable & ~masked & (cand != block) & (cand_conf > knobs.editing_threshold[:, None])
    written = torch.where(fill | edit, cand, block)

    # 5. anti-loop: an exact repeat of a written block of this block moves one changed position.
    changed = written != block
    H = state.history.shape[1]
    live = torch.arange(H, device=device)[None, :] < state.history_len[:, None]
    same = state.history == written[:, None, :]  # [R, H, L]
    repeat = active & ~final & changed.any(-1) & (same.all(-1) & live).any(-1)
    escape_pos = torch.where(changed, cand_conf, torch.inf).argmin(-1)  # least confident, first on ties
    rows = torch.arange(R, device=device)
    at = positions[None, :] == escape_pos[:, None]
    # a retry changes only position escape_pos: compare the rest once, then that one token per retry
    same_elsewhere = (same | at[:, None, :]).all(-1) & live  # [R, H]
    history_at = state.history[rows, :, escape_pos]  # [R, H]
    row_logits = logits[rows, escape_pos].clone()  # [R, V]: one position per row
    row_logits[:, mask_id] = -torch.inf
    # scatter_ with a scalar, not index_put_: a graph cannot capture index_put_'s host-side scalar copy
    row_logits.scatter_(1, cand[rows, escape_pos][:, None], -torch.inf)
    pending = repeat
    for _ in range(escape_retries):
        alt = row_logits.argmax(-1)
        row_logits.scatter_(1, alt[:, None], -torch.inf)
        written = torch.where(at & pending[:, None], alt[:, None], written)
        pending = pending & (same_elsewhere & (history_at == alt[:, None])).any(-1)

    # history records the written block (after escape, before the scan)
    slot = state.history_len % H
    record = state.history[rows, slot]
    state.history[rows, slot] = torch.where(active[:, None], written, record)
    state.history_len += active.long()

    # 6. edit scan
    new_block, new_orig = edit_scan(written, block, state.orig_mask, editable, mask_id=mask_id,
                                    delete_id=delete_id, split_id=split_id)
    new_block = torch.where(active[:, None], new_block, block)
    state.orig_mask.copy_(torch.where(active[:, None], new_orig, state.orig_mask))
    # 7. counters
    state.post_steps.copy_(torch.where(active, post, state.post_steps))
    state.step += active.long()
    state.finalized |= final
    block_final = ~masked.any(-1) & (new_block == block).all(-1)
    return LevenshteinStepOutput(new_block, fill.sum(-1), edit.sum(-1), final, block_final, repeat, written)


class LevenshteinJoint(Decoder):
    """The engine's decoder: `levenshtein_step` on the batch rows that carry full logits. Its seat
    state is the protocol's: counters (t, post steps, N, finalized), the original-mask bitmap as a
    column and the written blocks as the history log, all zero at block entry; the first forward
    of a block (t == 0) takes its masks as the original ones."""

    name = "levenshtein_joint"
    knobs = ("threshold", "editing_threshold", "steps", "max_post_steps", "max_steps_per_block")
    edits = True
    needs_logits = True
    greedy_only = True
    special_ids = ("delete_id", "split_id")
    state = ("step", "post_steps", "num_initial", "finalized")
    columns = ("orig_mask",)
    logs = True  # the written blocks, for the anti-loop's exact-repeat check
    reopened_state = {"finalized": 0}  # a finalized row changes nothing more: masks a grammar left need rounds

    def step(self, batch: DecodeBatch) -> DecoderStep:
        rows = batch.logit_rows
        block, masked = batch.block[rows], batch.masked[rows]
        counters = {k: batch.state[k][rows] for k in self.state}
        entering = counters["step"] == 0
        state = LevenshteinState(
            orig_mask=torch.where(entering[:, None], masked, batch.columns["orig_mask"][rows].bool()),
            num_initial=torch.where(entering, masked.sum(-1), counters["num_initial"]),
            step=counters["step"].clone(), post_steps=counters["post_steps"].clone(),
            finalized=counters["finalized"].bool(), history=batch.history[rows],
            history_len=batch.history_len[rows].clone())
        logged = ~state.finalized
        k = batch.knobs
        knobs = LevenshteinKnobs(k["threshold"][rows], k["editing_threshold"][rows], k["steps"][rows],
                                 k["max_post_steps"][rows], k["max_steps_per_block"][rows])
        out = levenshtein_step(batch.logits, block, (~batch.editable[rows]).sum(-1), state, knobs,
                               mask_id=batch.mask_id, delete_id=batch.special["delete_id"],
                               split_id=batch.special["split_id"])

        def scatter(full: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
            return full.clone().index_copy_(0, rows, sub.to(full.dtype))

        zeros = torch.zeros_like(batch.block[:, 0])
        new_state = {"step": state.step, "post_steps": state.post_steps, "num_initial": state.num_initial,
                     "finalized": state.finalized}
        return DecoderStep(
            block=scatter(batch.block, out.block), filled=scatter(zeros, out.num_filled),
            edited=scatter(zeros, out.num_edited),
            final=scatter(zeros.bool(), out.final_round | out.block_final),
            state={key: scatter(batch.state[key], value) for key, value in new_state.items()},
            columns={"orig_mask": scatter(batch.columns["orig_mask"], state.orig_mask)},
            log=scatter(batch.block, out.written), logged=scatter(zeros.bool(), logged))
