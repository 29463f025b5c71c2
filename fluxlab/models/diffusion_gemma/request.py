"""A Diffusion-Gemma request: canvases are its blocks, aligned to the prompt's end.

transformers puts canvas k at positions P + k*L .. P + (k+1)*L - 1 (P prompt tokens, L canvas
length), so blocks cannot start at position 0 as LLaDA2's do. The request's token array is
left-padded with `num_pad = (-P) % L` slots holding PAD_SLOT (-1, never a token id): block
boundaries then fall on canvas boundaries, every prompt block is final from the start and the
scheduler, pages and prefix cache treat canvases like any block. Position = index - num_pad; pad
slots are never computed, written or attended. PAD_SLOT in a block's cache key keeps two prompts
apart whose blocks hold the same ids at different positions.
"""
from __future__ import annotations

from typing import Optional

from fluxlab.models.diffusion_gemma.decoding import CanvasKnobs, CanvasState
from fluxlab.engine.request import SamplingParams
from fluxlab.engine.sequence import Request

PAD_SLOT = -1


class CanvasRequest(Request):
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, canvas_length: int,
                 eos_ids: tuple[int, ...], knobs: CanvasKnobs):
        num_pad = (-len(prompt_ids)) % canvas_length
        super().__init__(request_id, [PAD_SLOT] * num_pad + list(prompt_ids), params, canvas_length, PAD_SLOT,
                         eos_ids)
        self.prompt_ids = list(prompt_ids)
        self.num_pad = num_pad
        self.knobs = knobs
        self.canvas: Optional[CanvasState] = None  # created on the device by the canvas runner
        self.sliding_pages: list[int] = []  # sliding layers' ring (canvas_pages.py): block b on [b % len]

    def sampler_state(self) -> Optional[tuple]:
        """The canvas state before a step (its generator, canvas and stopping history); None: no canvas yet."""
        return None if self.canvas is None else self.canvas.snapshot()

    def restore_sampler_state(self, state: Optional[tuple]) -> None:
        if state is None:
            self.canvas = None
        else:
            self.canvas.restore(state)
