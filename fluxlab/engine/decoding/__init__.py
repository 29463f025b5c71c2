"""One decoding step for every active block of a forward, vectorised over rows with per-row knobs.

`decode_step` runs on the device and hands back one host copy of the new blocks (the single sync a
step needs); `advance` applies a row's result to its request and says whether its block is final.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fluxlab.engine.decoding.hierarchy import hierarchy_accept
from fluxlab.engine.decoding.joint_threshold import joint_accept
from fluxlab.engine.decoding.sampling import propose
from fluxlab.engine.decoding.threshold import threshold_accept
from fluxlab.engine.sequence import Request


@dataclass
class StepResult:
    block_tokens: list[int]
    num_filled: int  # mask -> token
    num_edited: int  # token -> token (joint_threshold)
    masks_left: int


def _generator(request: Request, device: torch.device) -> torch.Generator:
    if request.generator is None:
        request.generator = torch.Generator(device=device)
        request.generator.manual_seed(request.params.seed)
    return request.generator


def decode_step(requests: list[Request], logits: torch.Tensor, mask_id: int) -> list[StepResult]:
    """logits [R, bl, V] fp32 of each request's active block -> the block after this step."""
    device = logits.device
    bl = logits.shape[1]
    params = [r.params for r in requests]
    block = torch.tensor([r.block_tokens(r.active_block) for r in requests], device=device)
    prompt_len = torch.tensor([r.num_prompt_positions_in_active_block() for r in requests], device=device)
    editable = torch.arange(bl, device=device)[None, :] >= prompt_len[:, None]
    masked = (block == mask_id) & editable  # a literal mask token in the prompt is prompt text

    def per_row(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=device)

    threshold = per_row([p.threshold for p in params])
    sampling = any(p.temperature > 0 for p in params)
    tokens, conf = propose(logits, [p.temperature for p in params], [p.top_k for p in params],
                           [p.top_p for p in params],
                           [_generator(r, device) if sampling and r.params.temperature > 0 else None for r in requests])
    kinds = {p.decoder for p in params}
    fill = torch.zeros_like(masked)
    edit = torch.zeros_like(masked)
    if "threshold" in kinds:
        counts = [r.transfer_count() for r in requests]
        rows = per_row([p.decoder == "threshold" for p in params], torch.bool)[:, None]
        fill |= rows & threshold_accept(conf, masked, threshold, per_row(counts, torch.long), max(counts))
    if "hierarchy" in kinds:
        rows = per_row([p.decoder == "hierarchy" for p in params], torch.bool)[:, None]
        fill |= rows & hierarchy_accept(conf, masked, threshold, per_row([p.low_threshold for p in params]))
    if "joint_threshold" in kinds:
        rows = per_row([p.decoder == "joint_threshold" for p in params], torch.bool)[:, None]
        j_fill, j_edit = joint_accept(tokens, conf, block, masked, editable, threshold,
                                      per_row([p.editing_threshold for p in params]))
        fill |= rows & j_fill
        edit |= rows & j_edit
    new_block = torch.where(fill | edit, tokens, block)
    counts = torch.stack([fill.sum(-1), edit.sum(-1), ((new_block == mask_id) & editable).sum(-1)], dim=1)
    host = torch.cat([new_block, counts], dim=1).cpu().tolist()
    return [StepResult(row[:bl], row[bl], row[bl + 1], row[bl + 2]) for row in host]


def advance(request: Request, result: StepResult) -> bool:
    """Apply one step to the request's active block; True when the block is final."""
    params = request.params
    request.stats.forwards += 1
    request.stats.tokens_accepted += result.num_filled
    if params.decoder == "joint_threshold":
        if result.num_filled == 0 and result.num_edited == 0:
            return True  # a forward that changes nothing ends the block
        request.set_active_block_tokens(result.block_tokens)
        request.step_in_block += 1
        if result.masks_left == 0:
            # Post steps: forwards on a block without masks; past max_post_steps the block is final.
            if request.post_steps + 1 > params.max_post_steps:
                return True
            request.post_steps += 1
        return False
    request.set_active_block_tokens(result.block_tokens)
    request.step_in_block += 1
    return result.masks_left == 0
