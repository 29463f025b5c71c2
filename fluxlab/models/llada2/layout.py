"""LLaDA2's published tensor names and shapes (`checkpoint_layout`) and the random values of each
(`random_tensor(s)`): the one list loading, random weights and the checkpoint writer read."""
from __future__ import annotations

import math
from typing import Iterator

import torch

from fluxlab.engine.weights import uniform_tensor
from fluxlab.models.llada2.model import LLaDA2MoeConfig


class Slot:
    """Where an official tensor lands in our model: parameter name + optional index into it."""

    __slots__ = ("param", "index", "shape", "group")

    def __init__(self, param: str, shape: tuple, group: str, index=None):
        self.param, self.shape, self.group, self.index = param, tuple(shape), group, index


def checkpoint_layout(c: LLaDA2MoeConfig) -> dict[str, Slot]:
    """Official name -> Slot, in checkpoint order (embeddings, layer 0..L-1, final norm, lm_head)."""
    H, D = c.hidden_size, c.head_dim
    out: dict[str, Slot] = {"model.word_embeddings.weight": Slot("word_embeddings.weight", (c.vocab_size, H), "embed")}
    for i in range(c.num_hidden_layers):
        g, p, o = f"layer{i}", f"layers.{i}.", f"model.layers.{i}."

        def add(name, shape, param=None, index=None):
            out[o + name] = Slot(p + (param or name), shape, g, index)

        add("input_layernorm.weight", (H,))
        add("attention.query_key_value.weight", ((c.num_attention_heads + 2 * c.num_key_value_heads) * D, H))
        if c.use_qk_norm:
            add("attention.query_layernorm.weight", (D,))
            add("attention.key_layernorm.weight", (D,))
        add("attention.dense.weight", (H, c.num_attention_heads * D))
        add("post_attention_layernorm.weight", (H,))
        if not c.is_moe_layer(i):
            add("mlp.gate_proj.weight", (c.intermediate_size, H))
            add("mlp.up_proj.weight", (c.intermediate_size, H))
            add("mlp.down_proj.weight", (H, c.intermediate_size))
            continue
        add("mlp.gate.weight", (c.num_experts, H))
        add("mlp.gate.expert_bias", (c.num_experts,))
        inter = c.moe_intermediate_size
        for e in range(c.num_experts):
            add(f"mlp.experts.{e}.gate_proj.weight", (inter, H), "mlp.experts.w_gate_up", (e, slice(0, inter)))
            add(f"mlp.experts.{e}.up_proj.weight", (inter, H), "mlp.experts.w_gate_up", (e, slice(inter, 2 * inter)))
            add(f"mlp.experts.{e}.down_proj.weight", (H, inter), "mlp.experts.w_down", (e,))
        if c.num_shared_experts:
            si = inter * c.num_shared_experts
            add("mlp.shared_experts.gate_proj.weight", (si, H))
            add("mlp.shared_experts.up_proj.weight", (si, H))
            add("mlp.shared_experts.down_proj.weight", (H, si))
    out["model.norm.weight"] = Slot("norm.weight", (H,), "head")
    out["lm_head.weight"] = Slot("lm_head.weight", (c.vocab_size, H), "head")
    return out



def _init_std(name: str, shape: tuple, c: LLaDA2MoeConfig, peaked: bool) -> float | None:
    """std for a random tensor; None means "all ones" (norm weights)."""
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return None
    if name.endswith("expert_bias"):
        return 0.05 if peaked else 0.0
    if not peaked:
        return 0.02
    if name == "model.word_embeddings.weight":
        return 1.0
    if name == "lm_head.weight":
        return PEAKED_LM_HEAD_STD
    return 1.0 / math.sqrt(shape[-1])  # fan-in scaling keeps every projection O(1)


# Tiny-model knobs (fluxlab/checkpoint.py): sharp logits so threshold 0.9 accepts several tokens a
# step, an EOS row boosted so sequences end sometimes, a small mask embedding so masked positions
# are driven by their context (attention) rather than all looking alike. Measured on 6 chat prompts,
# 256 new tokens, block 32, threshold 0.9: 4-11 tokens per forward, 3 of 6 stop on EOS after
# 100-150 tokens, the rest run to length.
PEAKED_LM_HEAD_STD = 2.0
PEAKED_EOS_GAIN = 2.5
PEAKED_MASK_GAIN = 0.05
# tiny_llada22: DELETE/SPLIT rows boosted so the edit scan runs: measured on 256 corpus tokens, the
# argmax is DELETE at 3.5% and SPLIT at 2.3% of positions (0% for both at gain 1).
PEAKED_EDIT_GAIN = 2.0


def random_tensor(c: LLaDA2MoeConfig, name: str, shape: tuple, seed: int = 0, *, peaked: bool = False,
                  special_ids: dict | None = None, device=None) -> torch.Tensor:
    """The official tensor `name` (fp32), generated independently from (seed, name)."""
    special_ids = special_ids or {}
    std = _init_std(name, shape, c, peaked)
    if std is None:
        t = torch.ones(shape, dtype=torch.float32, device=device)
    elif std == 0.0:
        t = torch.zeros(shape, dtype=torch.float32, device=device)
    else:
        t = uniform_tensor(shape, std, seed, name, device)
    if peaked and name == "model.word_embeddings.weight" and "mask" in special_ids:
        t[special_ids["mask"]] *= PEAKED_MASK_GAIN
    if peaked and name == "lm_head.weight" and "eos" in special_ids:
        t[special_ids["eos"]] *= PEAKED_EOS_GAIN
    if peaked and name == "lm_head.weight":
        for role in ("delete", "split"):
            if role in special_ids:
                t[special_ids[role]] *= PEAKED_EDIT_GAIN
    return t


def random_tensors(c: LLaDA2MoeConfig, seed: int = 0, *, peaked: bool = False, special_ids: dict | None = None,
                   groups=None, device=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (official name, fp32 tensor) for every tensor of `c`, optionally only some groups
    ("embed", "layer{i}", "head"), each generated independently from (seed, name)."""
    for name, slot in checkpoint_layout(c).items():
        if groups is not None and slot.group not in groups:
            continue
        yield name, random_tensor(c, name, slot.shape, seed, peaked=peaked, special_ids=special_ids, device=device)
