"""LLaDA2.1 joint threshold: mask-to-token acceptance and token-to-token edits from one forward."""
from __future__ import annotations

import torch

from fluxlab.engine.decoding.base import Accepted, DecodeBatch, Decoder, masked_scores, most_confident


class JointThreshold(Decoder):
    name = "joint_threshold"
    knobs = ("threshold", "editing_threshold", "max_post_steps")
    edits = True
    state = ("post_steps",)

    def accept(self, batch: DecodeBatch) -> Accepted:
        """fill: masked positions above threshold, else the single most confident masked one.
        edit: non-mask, non-prompt positions whose proposal differs from the current token with
        confidence above editing_threshold (0.0 edits whenever it differs). Edits run while masks
        remain too, as in the published LLaDA2.1 decoder."""
        score = masked_scores(batch)
        fill = score > batch.knobs["threshold"][:, None]
        fill = torch.where(fill.any(dim=-1, keepdim=True), fill, most_confident(score, batch.masked))
        edit = (~batch.masked & batch.editable & (batch.tokens != batch.block)
                & (batch.conf > batch.knobs["editing_threshold"][:, None]))
        return Accepted(fill, edit)

    def finish(self, batch, accepted, masks_left):
        """Final when a forward changes nothing, or when a forward on a block without masks would
        be post step number max_post_steps + 1."""
        changed = (accepted.fill | accepted.edit).any(dim=-1)
        post = batch.state["post_steps"]
        no_masks = masks_left == 0
        over = no_masks & (post + 1 > batch.knobs["max_post_steps"])
        final = ~changed | over
        return final, {"post_steps": torch.where(no_masks & ~final, post + 1, post)}
