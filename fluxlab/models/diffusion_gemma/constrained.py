"""The block-aware rule (fluxlab/engine/constraint/rule.py) on Diffusion-Gemma's canvas decoder.

The canvas has no mask token: every position holds a token every step (accepted ones, noise on the
rest). What the rule calls *decided* is, for a constrained canvas, the positions the last step
accepted (entropy bound), kept on the request's CanvasState as `decided` (UNDECIDED elsewhere); the
rule's BlockGuard sees that view, never the noise. Per step, for each constrained row:

1. before the sampler: the guard walks the decided view from the matcher's committed state; the
   logits (soft-capped, before the temperature) of the first undecided position get the grammar's
   mask, so whatever is sampled or taken as argmax there is valid;
2. the canvas step runs unchanged (`canvas_step`: the same draws from the request's generator);
3. the proposal is what the step decides: on a denoising step the accepted positions (sampled
   tokens), on a final step (the stop rule holds, or the N-th forward) the whole argmax canvas. The
   guard's repair walks it in position order: the first refused position goes back to undecided,
   positions right of an undecided one stay unchecked, EOS stands only where the grammar may end,
   and since the canvas re-proposes every position each step it edits like an editing decoder:
   an edit of the old valid prefix stands only if the walk passes that prefix and its first fill,
   otherwise the old prefix is put back whole;
4. the next canvas is the repaired view with the step's renoise draw on its undecided positions; a
   final step commits only when the repaired argmax canvas has no undecided output position (its
   walk reached the end, max_new_tokens or an accepted EOS). Otherwise the canvas is not final: its
   valid prefix stays decided and the rest goes on denoising. Past N forwards `last` stays true, so
   every further step is a final attempt at the schedule's last temperature, and each one grows the
   valid prefix by at least its masked first undecided position: a canvas of L positions ends
   within N + L forwards.

A grammar that accepts every token the run writes changes nothing: the mask removes no logit, no
walk refuses, so the canvas, the argmax and the committed tokens are the unconstrained run's.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from fluxlab.engine.constraint.rule import BlockGuard
from fluxlab.models.diffusion_gemma.decoding import CanvasState, CanvasStepResult, canvas_step

UNDECIDED = -1  # never a token id (the canvas request's PAD_SLOT has the same value: neither is output)


def constrained_canvas_step(logits: torch.Tensor, requests: list, states: list[CanvasState],
                            softcap) -> CanvasStepResult:
    """One canvas step of constrained rows: logits [C, L, V] the head's output (overwritten), the
    requests' canvases in their states. The result's `block` is the next canvas, or the committed one
    where `final`; each state's `decided` is updated (the caller stores canvas and self-conditioning)."""
    rows, length = logits.shape[0], logits.shape[1]
    logits = logits.float()  # compute_logits' ops, as denoise_step's raw path does them: the mask goes after
    if softcap:  # the soft-cap, which would turn -inf into -softcap
        logits.div_(softcap).tanh_().mul_(softcap)
    decided = np.stack([s.decided if s.decided is not None else np.full(length, UNDECIDED, dtype=np.int64)
                        for s in states])
    index = np.arange(rows)
    guard = BlockGuard(requests, index, decided, UNDECIDED)
    try:
        guard.mask_logits(logits, index)
        current = torch.stack([s.canvas for s in states])
        step = canvas_step(logits, current, states, [r.knobs for r in requests], inplace=True)
        host = torch.stack([step.block, step.taken.long(), step.noise, step.final[:, None].long().expand(rows, length)])
        block, taken, noise, final = host.cpu().numpy()
        final = final[:, 0].astype(bool)
        proposals = np.where(final[:, None] | taken.astype(bool), block, UNDECIDED)
        kept, complete = guard.repair(proposals)
    finally:
        guard.close()
    final &= complete
    canvas = np.where(kept == UNDECIDED, noise, kept)
    for i, state in enumerate(states):
        state.decided = None if final[i] else kept[i]
    device = step.block.device
    return dataclasses.replace(step, block=torch.from_numpy(canvas).to(device, step.block.dtype),
                               final=torch.from_numpy(final).to(device))
