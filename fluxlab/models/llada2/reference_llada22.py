"""LLaDA2.2 generate with levenshtein_joint, written plainly from DESIGN §5 (the definition of right).

Batch 1, no cache: every forward recomputes all blocks up to the active one with dense
block-causal attention. `LevenshteinBlock` applies the numbered rules one position at a time on
Python lists; the device step (fluxlab/engine/decoding/levenshtein_joint.py) must give the same
blocks. The choices where the rules leave room are listed in that module's docstring.
"""
from __future__ import annotations

from typing import Sequence

import torch

from fluxlab.engine.decoding.levenshtein_joint import ESCAPE_RETRIES
from fluxlab.engine.layers.attention_dense import DenseBlockCausalAttention
from fluxlab.models.llada2.reference_output import ReferenceOutput


def _best(row: torch.Tensor, excluded: set[int]) -> int:
    """argmax of one position's logits without some ids (torch.argmax: lowest id on ties)."""
    row = row.clone()
    row[list(excluded)] = -torch.inf
    return int(row.argmax())


class LevenshteinBlock:
    """One active block under levenshtein_joint; `step(logits)` is one forward."""

    def __init__(self, block: Sequence[int], prompt_len: int, *, mask_id: int, delete_id: int, split_id: int,
                 steps: int, threshold: float, editing_threshold: float, max_post_steps: int,
                 max_steps_per_block: int, escape_retries: int = ESCAPE_RETRIES):
        self.block = list(block)
        self.prompt_len = prompt_len
        self.mask_id, self.delete_id, self.split_id = mask_id, delete_id, split_id
        self.steps, self.threshold, self.editing_threshold = steps, threshold, editing_threshold
        self.max_post_steps, self.max_steps_per_block = max_post_steps, max_steps_per_block
        self.escape_retries = escape_retries
        gen = range(prompt_len, len(self.block))
        # original masks: present at block entry; the flag travels with its position through edits
        self.orig = [i in gen and t == mask_id for i, t in enumerate(self.block)]
        self.num_initial = sum(self.orig)
        self.t = 0
        self.post = 0
        self.finalized = False
        self.history: list[list[int]] = []
        self.last = {}  # what the last step did, for tests and stats

    def step(self, logits: torch.Tensor) -> bool:
        """Apply one forward's logits [L, V]; True when this forward's input was the final block."""
        L = len(self.block)
        block, mask = self.block, self.mask_id
        if self.finalized:
            self.last = {"filled": 0, "edited": 0, "final_round": False, "escaped": False, "scanned": 0}
            return True
        probs = torch.softmax(logits.float().index_fill(-1, torch.tensor([mask]), -torch.inf), dim=-1)
        cand = [_best(logits[i].float(), {mask}) for i in range(L)]
        conf = [float(probs[i, cand[i]]) for i in range(L)]
        gen = range(self.prompt_len, L)
        masks = [i for i in gen if block[i] == mask]
        unresolved = [i for i in masks if self.orig[i]]

        # 1. post steps
        self.post = 0 if unresolved else self.post + 1
        # 3. mask -> token on the schedule (needed by rule 2 when max_post_steps == 0)
        if self.t < self.steps:
            need = (self.num_initial // self.steps + (1 if self.t < self.num_initial % self.steps else 0)
                    + len(masks) - len(unresolved))
            high = [i for i in masks if conf[i] > self.threshold]
            fill = set(high) if len(high) >= need else set(sorted(masks, key=lambda i: (-conf[i], i))[:need])
        else:
            fill = set(masks)
        # 2. final round
        final = ((self.max_post_steps > 0 and self.post >= self.max_post_steps)
                 or (self.max_post_steps == 0 and all(i in fill for i in unresolved))
                 or self.t >= self.max_steps_per_block - 1)
        if final:
            fill = set(masks)
            cand = [_best(logits[i].float(), {mask, self.delete_id, self.split_id}) for i in range(L)]
            conf = [float(probs[i, cand[i]]) for i in range(L)]
        # 4. token -> token
        edit = {i for i in gen if block[i] != mask and cand[i] != block[i] and conf[i] > self.editing_threshold}
        written = list(block)
        for i in fill | edit:
            written[i] = cand[i]
        # 5. anti-loop
        escaped = False
        changed = [i for i in range(L) if written[i] != block[i]]
        if not final and changed and written in self.history:
            escaped = True
            p = min(changed, key=lambda i: (conf[i], i))
            tried = {mask, cand[p]}
            for _ in range(self.escape_retries):
                written[p] = _best(logits[p].float(), tried)
                tried.add(written[p])
                if written not in self.history:
                    break
        self.history.append(list(written))
        # 6. edit scan over generated positions; prompt positions never move or change
        new_block, new_orig = block[:self.prompt_len], self.orig[:self.prompt_len]
        scanned = sum(written[i] in (self.delete_id, self.split_id) for i in gen)
        for i in gen:
            if written[i] == self.delete_id:
                continue
            if written[i] == self.split_id:
                new_block += [mask, block[i]]
                new_orig += [False, self.orig[i]]
            else:
                new_block.append(written[i])
                new_orig.append(self.orig[i])
        pad = max(0, L - len(new_block))
        new_block, new_orig = (new_block + [mask] * pad)[:L], (new_orig + [False] * pad)[:L]
        # 7.
        self.t += 1
        self.finalized = final
        block_final = not masks and new_block == block
        self.last = {"filled": len(fill), "edited": len(edit), "final_round": final, "escaped": escaped,
                     "scanned": scanned}
        self.block, self.orig = new_block, new_orig
        return block_final


@torch.no_grad()
def reference_generate_llada22(model, prompt_ids: list[int], *, mask_id: int, stop_ids: Sequence[int],
                               delete_id: int, split_id: int, block_length: int = 32, steps: int | None = None,
                               max_new_tokens: int = 128, threshold: float = 0.5, editing_threshold: float = 0.0,
                               max_post_steps: int = 16, max_steps_per_block: int = 1000,
                               ignore_eos: bool = False) -> ReferenceOutput:
    """levenshtein_joint (LLaDA2.2) for one prompt, greedy. Prompt tokens (literal mask or edit ids
    included) are prompt text. A block ends at its final round (its tokens cannot change again, so
    the engine's committing forward is not run here) or at a forward over a mask-free block that
    changes nothing. Generation ends after the block that holds a stop id; the output is cut at
    max_new_tokens and before the first stop id."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    device = next(model.parameters()).device
    prompt_len = len(prompt_ids)
    num_blocks = -(-(prompt_len + max_new_tokens) // block_length)
    x = list(prompt_ids) + [mask_id] * (num_blocks * block_length - prompt_len)
    out = ReferenceOutput([], "length", 0)
    stops = set(stop_ids)

    for b in range(prompt_len // block_length, num_blocks):
        start, end = b * block_length, (b + 1) * block_length
        state = LevenshteinBlock(x[start:end], max(0, prompt_len - start), mask_id=mask_id, delete_id=delete_id,
                                 split_id=split_id, steps=steps or block_length, threshold=threshold,
                                 editing_threshold=editing_threshold, max_post_steps=max_post_steps,
                                 max_steps_per_block=max_steps_per_block)
        filled: list[int] = []
        while not state.finalized:
            ids = torch.tensor(x[:start] + state.block, dtype=torch.long, device=device)
            hidden = model(ids, torch.arange(end, device=device), DenseBlockCausalAttention([end], block_length))
            out.forwards += 1
            done = state.step(model.compute_logits(hidden[start:end]))
            filled.append(state.last["filled"])
            out.edits += state.last["edited"]
            out.scan_edits += state.last["scanned"]
            if done:
                break
        x[start:end] = state.block
        out.accepted_per_step.append(filled)
        generated = x[prompt_len:end]
        assert mask_id not in generated and delete_id not in generated and split_id not in generated
        if not ignore_eos and stops & set(generated):
            break

    generated = x[prompt_len:prompt_len + max_new_tokens]
    if not ignore_eos:
        first = next((i for i, t in enumerate(generated) if t in stops), None)
        if first is not None:
            generated, out.finish_reason = generated[:first], "stop"
    out.token_ids = generated
    out.canvas = x
    return out
