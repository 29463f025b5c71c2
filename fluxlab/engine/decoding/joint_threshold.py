"""LLaDA2.1 joint threshold: mask-to-token acceptance and token-to-token edits from one forward."""
from __future__ import annotations

import torch


def joint_accept(tokens: torch.Tensor, conf: torch.Tensor, block: torch.Tensor, masked: torch.Tensor,
                 editable: torch.Tensor, threshold: torch.Tensor,
                 editing_threshold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fill, edit) booleans [R, bl].

    fill: masked positions above threshold, else the single most confident masked one.
    edit: non-mask, non-prompt positions whose proposal differs from the current token with
    confidence above editing_threshold (0.0 edits whenever it differs). Edits run while masks
    remain too, as in the published LLaDA2.1 decoder.
    """
    score = torch.where(masked, conf, torch.full_like(conf, -torch.inf))
    fill = score > threshold[:, None]
    best = torch.zeros_like(masked).scatter(1, score.argmax(dim=-1, keepdim=True), True) & masked
    fill = torch.where(fill.any(dim=-1, keepdim=True), fill, best)
    edit = ~masked & editable & (tokens != block) & (conf > editing_threshold[:, None])
    return fill, edit
