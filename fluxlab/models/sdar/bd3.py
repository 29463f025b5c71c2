"""The SDAR authors' evaluation routine (OpenCompass `huggingface_bd3.py`, JetAstra/SDAR) as a block decoder.

Proposal: a float64 Gumbel noise tensor of the block's logits' shape is drawn from the request's generator first
(the routine draws it every forward; for its low_confidence remasking the noisy argmax is unused, but the draw
moves the generator, so the tokens after it depend on it), then generate.py's sampler (temperature, top-k,
top-p, one multinomial draw per position); confidence = the drawn token's probability under the
temperature-scaled *unfiltered* softmax. Temperature 0 (the routine asserts > 0) runs greedy: argmax and its
softmax probability, the rule the routine keeps commented out beside its sampler.
Acceptance: threshold < 1 is the dynamic rule (every masked position above threshold if at least k[s] are, else
the top k[s]), threshold = 1.0 the static one (no probability exceeds 1: always the top k[s]); proposals land on
masked positions only (the routine's x0 = where(mask, x0, cur_x)). The routine asserts block_length % steps == 0;
fluxlab runs the same schedule formula for any steps <= block_length.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fluxlab.models.sdar.low_confidence import LowConfidenceDynamic, published_filter


class Bd3(LowConfidenceDynamic):
    name = "bd3"
    knobs = ("threshold", "steps")

    def propose(self, logits, temperature, top_k, top_p, generator):
        torch.rand((1, *logits.shape), dtype=torch.float64, generator=generator, device=logits.device)
        scaled, filtered = published_filter(logits, temperature, top_k, top_p)
        tokens = torch.multinomial(F.softmax(filtered, dim=-1), num_samples=1, generator=generator)
        return tokens[:, 0], torch.gather(F.softmax(scaled, dim=-1), -1, tokens)[:, 0]
