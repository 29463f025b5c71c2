"""SDAR's generate.py (JetAstra/SDAR): the remasking strategies low_confidence_dynamic, low_confidence_static
and sequential, and its sampler, as block decoders.

The sampler is the published one, operation for operation: logits / temperature (skipped at 1.0), top-k, top-p,
softmax, one multinomial draw per position of the block from the request's generator; confidence = the drawn
token's probability under that *filtered* distribution. (fluxlab's default sampler, sampling.py, shifts the
logits by their maximum before dividing: the same distribution, different last bits at temperature != 1.)
Temperature 0 is not in the published routine (it divides by the temperature): fluxlab runs it greedy (argmax,
its softmax probability), the limit the block engine gives every decoder.

Transfer schedule: k[s] = block_length // steps, the first block_length % steps steps one more, s counting
forwards in the block (`steps` as given: SDAR does not cap it by max_new_tokens as LLaDA2.0 does).
- low_confidence_dynamic: every masked position above `threshold` if at least k[s] are, else the top k[s]
  (= fluxlab's threshold decoder's rule);
- low_confidence_static: the top k[s] masked positions (threshold unread);
- sequential: k[s] positions from the first masked one on.
A transfer fills masked positions only. Published generate.py writes its proposal wherever its top-k lands, so
when fewer masks than k[s] remain (the prompt's tail in the first block, or a dynamic step that filled more than
its share) it overwrites prompt or already-decided tokens with fresh samples; fluxlab never edits the prompt and
follows huggingface_bd3.py's guard (x0 = where(mask, x0, cur_x)), which keeps them. The two agree whenever
k[s] never exceeds the masks left: always for sequential (masks are a suffix of the block) and for
steps == block_length; docs/models.md (SDAR) says so.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fluxlab.engine.decoding.base import Accepted, DecodeBatch, masked_scores
from fluxlab.engine.decoding.threshold import Threshold, top_k_per_row, transfer_counts


def published_filter(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """SDAR's sample_with_temperature_topk_topp up to its softmax input (generate.py and huggingface_bd3.py
    share it): the temperature-scaled logits and the filtered ones."""
    scaled = logits / temperature if temperature != 1.0 else logits
    filtered = scaled
    if top_k > 0:
        kth = torch.topk(filtered, min(top_k, filtered.shape[-1])).values[..., -1, None]
        filtered = torch.where(filtered < kth, torch.full_like(filtered, float("-inf")), filtered)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, descending=True)
        drop = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1) > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        filtered = filtered.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return scaled, filtered


def schedule(batch: DecodeBatch) -> torch.Tensor:
    """[R] k[s] of each row, never more than its masks left (a transfer fills masks only)."""
    k = transfer_counts(batch.block.shape[-1], batch.knobs["steps"], batch.state["step"])
    return torch.minimum(k, batch.masked.sum(dim=-1))


class LowConfidenceDynamic(Threshold):
    name = "low_confidence_dynamic"
    knobs = ("threshold", "steps")

    def propose(self, logits, temperature, top_k, top_p, generator):
        probs = F.softmax(published_filter(logits, temperature, top_k, top_p)[1], dim=-1)
        tokens = torch.multinomial(probs, num_samples=1, generator=generator)
        return tokens[:, 0], torch.gather(probs, -1, tokens)[:, 0]

    def accept(self, batch: DecodeBatch) -> Accepted:
        score = masked_scores(batch)
        high = score > batch.knobs["threshold"][:, None]
        k = schedule(batch)
        fill = torch.where((high.sum(dim=-1) >= k)[:, None], high, top_k_per_row(score, k) & batch.masked)
        return Accepted(fill, torch.zeros_like(fill))


class LowConfidenceStatic(LowConfidenceDynamic):
    name = "low_confidence_static"
    knobs = ("steps",)

    def accept(self, batch: DecodeBatch) -> Accepted:
        fill = top_k_per_row(masked_scores(batch), schedule(batch)) & batch.masked
        return Accepted(fill, torch.zeros_like(fill))


class Sequential(LowConfidenceDynamic):
    name = "sequential"
    knobs = ("steps",)

    def accept(self, batch: DecodeBatch) -> Accepted:
        first = batch.masked.long().argmax(dim=-1)  # the first masked position (rows without masks fill none)
        pos = torch.arange(batch.block.shape[-1], device=batch.block.device)[None, :] - first[:, None]
        fill = (pos >= 0) & (pos < schedule(batch)[:, None]) & batch.masked
        return Accepted(fill, torch.zeros_like(fill))
