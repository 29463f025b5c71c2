"""SDAR's two published decoding routines, written plainly on fluxlab's SDARModel (batch 1, the whole sequence
recomputed each forward): the definition the engine's SDAR decoders are checked against.

Both routines (JetAstra/SDAR `generate.py`, the authors' OpenCompass `huggingface_bd3.py`) share the frame:
blocks of `block_length` aligned to position 0 (the prompt's tail sits unmasked in the first decoded block); per
block at most `steps` forwards, step s transferring k[s] = block // steps (+1 for the first block % steps steps)
masked positions; a block without masks is final (its K/V are written by one more forward, which changes no
token); after a block, generation stops if the output so far (everything after the prompt) holds a stop id.

They differ in the proposal and its confidence, and in what a transfer may overwrite:
- "generate": temperature (skipped at 1.0), top-k, top-p, softmax, one multinomial draw per position; confidence
  = the drawn token's probability under that *filtered* distribution. Remasking: low_confidence_dynamic (all
  masked positions above `threshold` if at least k[s], else the top k[s]), low_confidence_static (top k[s]),
  sequential (k[s] positions from the first mask on). The top-k runs over every position of the block with
  non-masked ones at -inf, and the transfer writes proposals wherever it lands: when fewer masks than k[s] remain,
  it can overwrite a non-mask position (a prompt-tail token of the first block included). We keep that rule.
- "bd3": Gumbel noise is drawn (float64, as the routine does; at temperature > 0 it consumes the generator but
  the argmax it feeds is unused for low_confidence), then the same sampling, with confidence = the drawn token's
  probability under the temperature-scaled but *unfiltered* softmax. Proposals are kept only at masked positions.
  threshold < 1 is the dynamic rule, threshold >= 1 the static one; block_length must be a multiple of steps.
The generator is consumed in the routines' order: bd3's rand (float64, [1, block, vocab]) then one multinomial of
[block, vocab] per forward; "generate" only the multinomial. Temperature must be > 0 in both (they divide by it,
and bd3 asserts it). "entropy_bounded" (generate.py) is not offered: the published branch reads `transfer_index`
before assigning it and raises on its first step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fluxlab.engine.layers.attention_dense import DenseBlockCausalAttention

REMASKING = ("low_confidence_dynamic", "low_confidence_static", "sequential")


def transfer_schedule(block_length: int, steps: int) -> list[int]:
    base, extra = divmod(block_length, steps)
    return [base + (s < extra) for s in range(steps)]


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0:
        kth = torch.topk(logits, top_k).values[..., -1, None]
        logits = torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        drop = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1) > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def propose(logits: torch.Tensor, routine: str, temperature: float, top_k: int, top_p: float, generator):
    """logits [bl, V] -> (tokens [bl], confidence [bl]) as the routine samples them."""
    if temperature <= 0:
        raise ValueError("SDAR's published routines sample: temperature must be > 0")
    if routine == "bd3":
        torch.rand((1, *logits.shape), dtype=torch.float64, generator=generator)  # its Gumbel draw
        logits = logits / temperature if temperature != 1.0 else logits
        unfiltered = F.softmax(logits, dim=-1)
    else:
        logits = logits / temperature if temperature != 1.0 else logits
    probs = F.softmax(_filter(logits, top_k, top_p), dim=-1)
    tokens = torch.multinomial(probs, num_samples=1, generator=generator)
    conf = torch.gather(unfiltered if routine == "bd3" else probs, -1, tokens)
    return tokens[:, 0], conf[:, 0]


def select(conf: torch.Tensor, masked: torch.Tensor, k: int, remasking: str, threshold: float) -> torch.Tensor:
    """[bl] bool: the positions this step transfers."""
    chosen = torch.zeros_like(masked)
    if remasking == "sequential":
        first = int(masked.nonzero()[0, 0])
        chosen[first:first + k] = True
        return chosen
    score = torch.where(masked, conf, torch.tensor(-torch.inf))
    if remasking == "low_confidence_dynamic":
        high = score > threshold
        if int(high.sum()) >= k:
            return high
    chosen[torch.topk(score, k).indices] = True
    return chosen


@torch.no_grad()
def sdar_generate(model, prompt: list[int], *, mask_id: int, max_new_tokens: int, block_length: int, steps: int,
                  routine: str = "generate", remasking: str = "low_confidence_dynamic", threshold: float = 0.85,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, stop_ids=(),
                  generator: torch.Generator | None = None) -> list[int]:
    """The routine's whole canvas (prompt, output, and the mask ids of blocks never decoded), as it returns x."""
    if routine not in ("generate", "bd3"):
        raise ValueError(f"routine {routine!r}: use 'generate' or 'bd3'")
    if routine == "bd3":
        if block_length % steps:
            raise ValueError("bd3 needs block_length to be a multiple of steps")
        remasking = "low_confidence_dynamic" if threshold < 1.0 else "low_confidence_static"
    elif remasking not in REMASKING:
        raise ValueError(f"remasking {remasking!r}: use one of {', '.join(REMASKING)}")
    n = len(prompt)
    num_blocks = -(-(n + max_new_tokens) // block_length)
    device = model.lm_head.weight.device
    x = torch.full((num_blocks * block_length,), mask_id, dtype=torch.long, device=device)
    x[:n] = torch.tensor(prompt, dtype=torch.long, device=device)
    schedule = transfer_schedule(block_length, steps)
    for b in range(n // block_length, num_blocks):
        lo, hi = b * block_length, (b + 1) * block_length
        for s in range(steps):
            masked = x[lo:hi] == mask_id
            if not masked.any():
                break
            hidden = model(x[:hi], torch.arange(hi, device=device), DenseBlockCausalAttention([hi], block_length))
            tokens, conf = propose(model.compute_logits(hidden[lo:hi]), routine, temperature, top_k, top_p, generator)
            if routine == "bd3":
                tokens = torch.where(masked, tokens, x[lo:hi])
            chosen = select(conf, masked, schedule[s], remasking, threshold)
            x[lo:hi] = torch.where(chosen, tokens, x[lo:hi])
        if any(bool((x[n:] == stop).any()) for stop in stop_ids):
            break
    return x.tolist()
