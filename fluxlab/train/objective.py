"""The block-diffusion training objective (LLaDA2.0's BDLM loss), on fluxlab's own model modules.

A training row is [noisy copy | clean copy] of one sequence (2L tokens, both at positions 0..L-1).
Blocks are aligned to absolute positions, as the engine decodes them. The mask (True = may attend):
  noisy block k  -> noisy block k (bidirectional) and clean blocks < k;
  clean block k  -> clean blocks <= k (block-causal, what the KV cache holds at inference).
Only reply positions are ever noised (SFT: the prompt stays clean); each row draws t ~ U(eps, 1)
and masks each reply token with probability t. The loss is the cross-entropy on masked tokens,
weighted by 1/t (the ELBO weighting of the LLaDA papers), plus LLaDA2.1's token-to-token part:
a share EDIT_RATE of the unmasked reply tokens is replaced by random tokens, and every unmasked
reply position learns to predict the clean token (keep it, or correct it), so an editing decoder
(joint_threshold) sees meaningful predictions at committed positions. Both are averaged over
reply tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fluxlab.engine.layers.norm import rms_norm

EDIT_RATE = 0.1


def bd_attention_mask(length: int, block_length: int, device=None) -> torch.Tensor:
    """[2L, 2L] bool mask over [noisy | clean] for sequences of `length` tokens."""
    block = torch.arange(length, device=device) // block_length
    same = block[:, None] == block[None, :]
    before = block[None, :] < block[:, None]
    at_or_before = block[None, :] <= block[:, None]
    none = torch.zeros(length, length, dtype=torch.bool, device=device)
    top = torch.cat([same, before], dim=1)  # noisy queries
    bottom = torch.cat([none, at_or_before], dim=1)  # clean queries
    return torch.cat([top, bottom], dim=0)


class TrainingAttention:
    """The model's attention backend for training: rows of equal length, one shared dense mask."""

    def __init__(self, num_rows: int, row_length: int, mask: torch.Tensor):
        self.num_rows, self.row_length, self.mask = num_rows, row_length, mask

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, N = self.num_rows, self.row_length
        heads, kv_heads, D = q.shape[1], k.shape[1], q.shape[2]
        qb = q.view(B, N, heads, D).transpose(1, 2)
        kb = k.view(B, N, kv_heads, D).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
        vb = v.view(B, N, kv_heads, D).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=self.mask, scale=D ** -0.5)
        return o.transpose(1, 2).reshape(B * N, heads, D)


def dense_moe(moe, x: torch.Tensor) -> torch.Tensor:
    """The MoE block's function with every expert run on every token, weighted by the router's
    (sparse) weights: the same sum as the engine's grouped experts (unchosen experts weigh 0), as
    two wide matmuls with no per-expert loop or host sync, which is what makes training fast."""
    experts = moe.experts
    E, I = experts.num_local_experts, experts.intermediate_size
    topk_idx, topk_weight = moe.gate(x)
    weight = torch.zeros(x.shape[0], E, dtype=topk_weight.dtype, device=x.device).scatter(1, topk_idx, topk_weight)
    gate_up = (x @ experts.w_gate_up.reshape(E * 2 * I, -1).t()).view(-1, E, 2 * I)
    gate, up = gate_up.split(I, dim=-1)
    h = F.silu(gate) * up * weight[..., None].to(gate_up.dtype)  # [T, E, I]
    y = h.reshape(x.shape[0], E * I) @ experts.w_down.transpose(1, 2).reshape(E * I, -1)
    if moe.shared_experts is not None:
        y = y + moe.shared_experts(x)
    return y.to(x.dtype)


def hidden_states(model, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
    """The engine model's forward with gradients (its own `forward` is inference-only, no_grad),
    layer by layer through the model's own modules; on CUDA the MoE blocks through `dense_moe`."""
    from fluxlab.models.llada2.model import LLaDA2MoeSparseMoeBlock

    x = model.word_embeddings(input_ids)
    cos, sin = model.rotary_emb.cos_sin(positions, x.dtype)
    cos_sin = (cos[:, None, :], sin[:, None, :])
    for layer in model.layers:
        x = x + layer.attention(layer.input_layernorm(x), cos_sin, attn)
        normed = layer.post_attention_layernorm(x)
        # On CPU the module's own per-expert loop (only chosen experts) is cheaper than dense_moe.
        dense = isinstance(layer.mlp, LLaDA2MoeSparseMoeBlock) and x.is_cuda
        x = x + (dense_moe(layer.mlp, normed) if dense else layer.mlp(normed))
    return x


def noise(ids: torch.Tensor, reply_mask: torch.Tensor, mask_id: int, num_ordinary: int,
          generator: torch.Generator, eps: float = 1e-3):
    """-> (noisy ids, masked positions, corrupted positions, t per row) for ids [B, L] and reply
    positions [B, L]; corruptions are uniform over the ordinary (non-special) ids < num_ordinary."""
    B, L = ids.shape
    dev = ids.device
    t = eps + (1 - eps) * torch.rand(B, 1, generator=generator, device=dev)
    u = torch.rand(B, L, generator=generator, device=dev)
    masked = (u < t) & reply_mask
    corrupted = (torch.rand(B, L, generator=generator, device=dev) < EDIT_RATE) & reply_mask & ~masked
    random_ids = torch.randint(0, num_ordinary, (B, L), generator=generator, device=dev)
    noisy = torch.where(masked, mask_id, torch.where(corrupted, random_ids, ids))
    return noisy, masked, corrupted, t


def bd_loss(model, ids: torch.Tensor, reply_mask: torch.Tensor, mask_id: int, num_ordinary: int,
            block_length: int, generator: torch.Generator) -> tuple[torch.Tensor, dict]:
    """The loss of a batch ids [B, L] -> (loss, stats as 0-d tensors). No host sync: positions
    are weighted, not gathered, so the CPU can queue the next step while the GPU runs this one."""
    B, L = ids.shape
    noisy, masked, corrupted, t = noise(ids, reply_mask, mask_id, num_ordinary, generator)
    rows = torch.cat([noisy, ids], dim=1)  # [B, 2L]
    positions = torch.arange(L, device=ids.device).repeat(2).repeat(B)
    attn = TrainingAttention(B, 2 * L, bd_attention_mask(L, block_length, ids.device))
    hidden = hidden_states(model, rows.reshape(-1), positions, attn).view(B, 2 * L, -1)[:, :L]
    logits = model.lm_head.logits(rms_norm(hidden, model.norm.weight, model.norm.eps).reshape(B * L, -1))
    ce = F.cross_entropy(logits, ids.reshape(-1), reduction="none").view(B, L)
    weight = torch.where(masked, 1.0 / t, reply_mask.float())  # 1/t on masked, 1 on other reply tokens
    loss = (ce * weight).sum() / reply_mask.sum().clamp(min=1)
    with torch.no_grad():
        right = (logits.argmax(-1).view(B, L) == ids).float()

        def share(where):
            return (right * where).sum() / where.sum().clamp(min=1)

        stats = {"acc_masked": share(masked.float()), "acc_corrected": share(corrupted.float())}
    return loss, stats
