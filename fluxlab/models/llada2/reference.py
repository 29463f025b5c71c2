"""The checkpoints' own `generate()` written plainly: the definition of right (DESIGN §5).

Batch 1, no cache: every forward recomputes the whole window (all blocks up to the active one)
with dense block-causal attention. Slow by design; the engine must reproduce its tokens at
temperature 0 in fp32.

Deliberate differences from the published code, all per DESIGN §5:
- temperature 0 is greedy argmax (the published LLaDA2.0 sampler calls multinomial even at 0);
- returned ids exclude the EOS (the published code returns it).
"""
from __future__ import annotations


import torch

from fluxlab.engine.layers.attention_dense import DenseBlockCausalAttention
from fluxlab.models.llada2.reference_output import ReferenceOutput


def transfer_schedule(block_length: int, steps: int) -> list[int]:
    """Tokens to unmask at each step of a block: block_length // steps each, the first
    block_length % steps steps one more (LLaDA2.0 `_get_num_transfer_tokens`)."""
    base, rem = divmod(block_length, steps)
    return [base + 1 if s < rem else base for s in range(steps)]


def sample_tokens(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  generator: torch.Generator | None = None):
    """logits [N, V] fp32 -> (tokens [N], confidence [N]).

    Greedy at temperature 0: argmax, confidence = its softmax probability over the full vocab.
    Otherwise temperature, top-k, top-p, then sample; confidence = probability of the sampled
    token under the filtered distribution (as the published sampler).
    """
    logits = logits.float()
    if temperature <= 0:
        probs = torch.softmax(logits, dim=-1)
        conf, tokens = probs.max(dim=-1)
        return tokens, conf
    # shifted, and a float32-representable divisor: any temperature > 0 stays finite (decoding/sampling.py)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, torch.finfo(logits.dtype).tiny)
    if top_k and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum > top_p
        drop[..., 1:] = drop[..., :-1].clone()  # keep the token that crosses top_p
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, sorted_idx, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1)


@torch.no_grad()
def reference_generate(model, prompt_ids: list[int], *, mask_id: int, eos_id: int, decoder: str = "threshold",
                       block_length: int = 32, steps: int | None = None, max_new_tokens: int = 128,
                       threshold: float = 0.9, editing_threshold: float = 0.5, max_post_steps: int = 16,
                       temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                       ignore_eos: bool = False, low_threshold: float = 0.3, stop_ids=None,
                       delete_id: int | None = None, split_id: int | None = None,
                       max_steps_per_block: int = 1000) -> ReferenceOutput:
    """Generate for one prompt; `decoder` is "threshold" (LLaDA2.0), "joint_threshold" (LLaDA2.1),
    "hierarchy" (dInfer) or "levenshtein_joint" (LLaDA2.2, greedy; needs delete_id/split_id, stops
    on any of stop_ids, default (eos_id,)). A literal mask id inside the prompt is prompt text.
    Decoder names and knob ranges are the registry's (fluxlab/engine/decoding/)."""
    from fluxlab.engine.decoding.knobs import KNOBS
    from fluxlab.engine.decoding.registry import DECODERS

    knobs = dict(threshold=threshold, editing_threshold=editing_threshold, max_post_steps=max_post_steps,
                 temperature=temperature, top_p=top_p, top_k=top_k, low_threshold=low_threshold,
                 steps=steps or block_length, max_steps_per_block=max_steps_per_block)
    for name, value in knobs.items():
        problem = KNOBS[name].problem(value, block_length)
        if problem:
            raise ValueError(f"reference_generate: {problem}")
    if decoder == "levenshtein_joint":
        from fluxlab.models.llada2.reference_llada22 import reference_generate_llada22

        if delete_id is None or split_id is None:
            raise ValueError("reference_generate: levenshtein_joint needs delete_id and split_id")
        if temperature > 0:
            raise ValueError("reference_generate: levenshtein_joint is greedy (temperature 0)")
        return reference_generate_llada22(model, prompt_ids, mask_id=mask_id, stop_ids=stop_ids or (eos_id,),
                                          delete_id=delete_id, split_id=split_id, block_length=block_length,
                                          steps=steps, max_new_tokens=max_new_tokens, threshold=threshold,
                                          editing_threshold=editing_threshold, max_post_steps=max_post_steps,
                                          max_steps_per_block=max_steps_per_block, ignore_eos=ignore_eos)
    if decoder not in DECODERS:
        raise ValueError(f"reference_generate: unknown decoder {decoder!r} ({', '.join(DECODERS)})")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    device = next(model.parameters()).device
    prompt_len = len(prompt_ids)
    num_blocks = -(-(prompt_len + max_new_tokens) // block_length)
    x = torch.full((num_blocks * block_length,), mask_id, dtype=torch.long, device=device)
    x[:prompt_len] = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    # Effective steps = min(steps, max_new_tokens) (published: min(steps, gen_length // minimal_topk)).
    schedule = transfer_schedule(block_length, min(steps or block_length, max_new_tokens))
    out = ReferenceOutput([], "length", 0)

    def logits_of_block(end: int) -> torch.Tensor:
        attn = DenseBlockCausalAttention([end], block_length)
        hidden = model(x[:end], torch.arange(end, device=device), attn)
        out.forwards += 1
        return model.compute_logits(hidden[end - block_length:])

    # Blocks wholly inside the prompt are never decoded; the first decoded one holds the prompt tail.
    for b in range(prompt_len // block_length, num_blocks):
        start, end = b * block_length, (b + 1) * block_length
        block = x[start:end]  # a view: writes land in x
        prompt_pos = torch.arange(start, end, device=device) < prompt_len
        accepted: list[int] = []
        if decoder == "threshold":
            for k in schedule:
                masked = (block == mask_id) & ~prompt_pos
                if not masked.any():
                    break
                tokens, conf = sample_tokens(logits_of_block(end), temperature, top_k, top_p, generator)
                conf = torch.where(masked, conf, -torch.inf)
                high = conf > threshold
                if int(high.sum()) >= k:
                    chosen = high
                else:
                    chosen = torch.zeros_like(masked)
                    chosen[torch.topk(conf, min(k, int(masked.sum()))).indices] = True
                block[chosen] = tokens[chosen]
                accepted.append(int(chosen.sum()))
        elif decoder == "hierarchy":
            while True:
                masked = (block == mask_id) & ~prompt_pos
                if not masked.any():
                    break
                tokens, conf = sample_tokens(logits_of_block(end), temperature, top_k, top_p, generator)
                chosen = _hierarchy_choice(masked.tolist(), conf.tolist(), threshold, low_threshold)
                chosen = torch.tensor(chosen, device=device)
                block[chosen] = tokens[chosen]
                accepted.append(int(chosen.sum()))
        else:
            accepted = _joint_threshold_block(block, prompt_pos, logits_of_block, end, mask_id, threshold,
                                              editing_threshold, max_post_steps, temperature, top_k, top_p,
                                              generator, out)
        out.accepted_per_step.append(accepted)
        generated = x[prompt_len:end]
        if not ignore_eos and bool((generated == eos_id).any()):
            break  # later blocks never influence this one: stopping changes no returned token

    generated = x[prompt_len:prompt_len + max_new_tokens].tolist()
    if not ignore_eos and eos_id in generated:
        generated = generated[:generated.index(eos_id)]
        out.finish_reason = "stop"
    out.token_ids = generated
    out.canvas = x.tolist()
    return out


def _hierarchy_choice(masked: list[bool], conf: list[float], threshold: float, low_threshold: float) -> list[bool]:
    """dInfer's hierarchy rule, position by position: in each contiguous run of masked positions
    its most confident one (the first on ties) if above low_threshold; every masked position above
    threshold; and always the single most confident masked position (the first on ties)."""
    n = len(masked)
    chosen = [m and c > threshold for m, c in zip(masked, conf)]
    i = 0
    while i < n:
        if not masked[i]:
            i += 1
            continue
        j = i
        while j < n and masked[j]:
            j += 1
        best = max(range(i, j), key=lambda p: (conf[p], -p))
        if conf[best] > low_threshold:
            chosen[best] = True
        i = j
    masked_pos = [p for p in range(n) if masked[p]]
    chosen[max(masked_pos, key=lambda p: (conf[p], -p))] = True
    return chosen


def _joint_threshold_block(block, prompt_pos, logits_of_block, end, mask_id, threshold, editing_threshold,
                           max_post_steps, temperature, top_k, top_p, generator, out) -> list[int]:
    """LLaDA2.1 joint threshold on one block (rules as in sglang's JointThreshold, DESIGN §5).

    Per forward, from the same logits:
    - mask-to-token: masked positions with confidence > threshold, else the single most confident;
    - token-to-token: non-mask, non-prompt positions whose predicted token differs from the current
      one with probability > editing_threshold. Edits run while masks remain too, not only after.
    A forward that sees no mask in the block counts one post step. The block is final when a
    forward changes nothing, or when post steps exceed max_post_steps: that forward's result would
    be discarded, so it is not run here (forwards count only the forwards whose output is used or
    that detect "no change").
    """
    accepted: list[int] = []
    post_steps = 0
    while True:
        masked = (block == mask_id) & ~prompt_pos
        if not masked.any():
            post_steps += 1
            if post_steps > max_post_steps:
                return accepted
        tokens, conf = sample_tokens(logits_of_block(end), temperature, top_k, top_p, generator)
        fill = torch.zeros_like(masked)
        if masked.any():
            mconf = torch.where(masked, conf, -torch.inf)
            fill = mconf > threshold
            if not fill.any():
                fill[mconf.argmax()] = True
        edit = ~masked & ~prompt_pos & (tokens != block) & (conf > editing_threshold)
        change = fill | edit
        if not change.any():
            return accepted
        block[change] = tokens[change]
        accepted.append(int(fill.sum()))
        out.edits += int(edit.sum())
