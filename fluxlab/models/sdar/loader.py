"""SDAR checkpoint <-> model: the published tensor names, random weights, loading a folder.

`checkpoint_layout(config)` is the one list of official names and shapes and where each lands in `SDARModel`
(q_proj/k_proj/v_proj stack into the fused qkv rows; the experts of a layer stack into StackedExperts); loading,
random weights and the checkpoint writer all read it.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from fluxlab.engine.weights import resolve_dtype, safetensor_files, uniform_tensor
from fluxlab.models.sdar.model import SDARConfig, SDARModel


class Slot:
    __slots__ = ("param", "shape", "index")

    def __init__(self, param: str, shape: tuple, index=None):
        self.param, self.shape, self.index = param, tuple(shape), index


def checkpoint_layout(c: SDARConfig) -> dict[str, Slot]:
    H, D, nq, nkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    out = {"model.embed_tokens.weight": Slot("embed_tokens.weight", (c.vocab_size, H))}
    for i in range(c.num_hidden_layers):
        p, o = f"layers.{i}.", f"model.layers.{i}."

        def add(name, shape, param=None, index=None):
            out[o + name] = Slot(p + (param or name), shape, index)

        add("input_layernorm.weight", (H,))
        qkv = "self_attn.qkv_proj.weight"
        add("self_attn.q_proj.weight", (nq * D, H), qkv, (slice(0, nq * D),))
        add("self_attn.k_proj.weight", (nkv * D, H), qkv, (slice(nq * D, (nq + nkv) * D),))
        add("self_attn.v_proj.weight", (nkv * D, H), qkv, (slice((nq + nkv) * D, (nq + 2 * nkv) * D),))
        add("self_attn.q_norm.weight", (D,))
        add("self_attn.k_norm.weight", (D,))
        add("self_attn.o_proj.weight", (H, nq * D))
        add("post_attention_layernorm.weight", (H,))
        if not c.is_moe_layer(i):
            add("mlp.gate_proj.weight", (c.intermediate_size, H))
            add("mlp.up_proj.weight", (c.intermediate_size, H))
            add("mlp.down_proj.weight", (H, c.intermediate_size))
            continue
        inter = c.moe_intermediate_size
        add("mlp.gate.weight", (c.num_experts, H))
        for e in range(c.num_experts):
            add(f"mlp.experts.{e}.gate_proj.weight", (inter, H), "mlp.experts.w_gate_up", (e, slice(0, inter)))
            add(f"mlp.experts.{e}.up_proj.weight", (inter, H), "mlp.experts.w_gate_up", (e, slice(inter, 2 * inter)))
            add(f"mlp.experts.{e}.down_proj.weight", (H, inter), "mlp.experts.w_down", (e,))
    out["model.norm.weight"] = Slot("norm.weight", (H,))
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = Slot("lm_head.weight", (c.vocab_size, H))
    return out


class _Assigner:
    def __init__(self, model: SDARModel):
        self.layout = checkpoint_layout(model.config)
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.tied = model.config.tie_word_embeddings
        self.seen: set[str] = set()

    def __call__(self, name: str, tensor: torch.Tensor):
        if self.tied and name == "lm_head.weight":  # some tied checkpoints still write the head: it must equal
            return
        slot = self.layout.get(name)
        if slot is None:
            raise ValueError(f"unexpected tensor {name!r} (shape {tuple(tensor.shape)}) in SDAR checkpoint")
        if tuple(tensor.shape) != slot.shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {slot.shape}")
        if name in self.seen:
            raise ValueError(f"tensor {name!r} appears twice in checkpoint")
        target = self.params[slot.param].data
        target = target if slot.index is None else target[slot.index]
        target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        self.seen.add(name)

    def finish(self):
        missing = [n for n in self.layout if n not in self.seen]
        if missing:
            raise ValueError(f"SDAR checkpoint is missing tensor {missing[0]!r} with shape "
                             f"{self.layout[missing[0]].shape}" + (f" (and {len(missing) - 1} more)"
                                                                   if len(missing) > 1 else ""))


def read_config(path) -> SDARConfig:
    with open(Path(path) / "config.json") as f:
        return SDARConfig.from_dict(json.load(f))


def load_model(path, dtype=torch.bfloat16, device=None, progress: bool = True, dims=None):
    """config.json + safetensors -> (SDARModel, SDARConfig); wrong, missing or extra tensors are named."""
    from safetensors import safe_open
    from tqdm import tqdm

    path = Path(path)
    config = read_config(path)
    device = torch.device(device) if device is not None else torch.device("cpu")
    model = SDARModel(config, dtype=resolve_dtype(dtype), device=device, dims=dims).eval()
    assign = _Assigner(model)
    with tqdm(total=len(assign.layout), desc="loading weights", unit="tensor", disable=not progress) as bar:
        for file in safetensor_files(path):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    assign(name, f.get_tensor(name))
                    bar.update(1)
    assign.finish()
    return model, config


# Random weights: std 0.02 projections and unit norms for the published shapes (flat logits, GPU timing); the
# tiny twins get fan-in scaled projections and a wide embedding/head so logits are peaked (several tokens pass
# a 0.9 threshold, samples are not all ties) and a small mask embedding, as fluxlab's tiny LLaDA2 checkpoint.
PEAKED_EMBED_STD = 1.0
PEAKED_MASK_GAIN = 0.05


def random_tensor(c: SDARConfig, name: str, shape: tuple, seed: int = 0, *, peaked: bool = False,
                  mask_id: int | None = None, device=None) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.float32, device=device)
    if not peaked:
        std = 0.02
    elif name in ("model.embed_tokens.weight", "lm_head.weight"):
        std = PEAKED_EMBED_STD
    else:
        std = 1.0 / math.sqrt(shape[-1])
    t = uniform_tensor(shape, std, seed, name, device)
    if peaked and name == "model.embed_tokens.weight" and mask_id is not None:
        t[mask_id] *= PEAKED_MASK_GAIN
    return t


def random_tensors(c: SDARConfig, seed: int = 0, *, peaked: bool = False, mask_id: int | None = None, device=None):
    for name, slot in checkpoint_layout(c).items():
        yield name, random_tensor(c, name, slot.shape, seed, peaked=peaked, mask_id=mask_id, device=device)


def build_random_model(config: SDARConfig | dict, dtype=torch.bfloat16, device=None, seed: int = 0,
                       peaked: bool = False, mask_id: int | None = None):
    """Random weights built on `device`, no file -> (model, config)."""
    config = config if isinstance(config, SDARConfig) else SDARConfig.from_dict(config)
    device = torch.device(device) if device is not None else torch.device("cpu")
    model = SDARModel(config, dtype=resolve_dtype(dtype), device=device).eval()
    assign = _Assigner(model)
    for name, tensor in random_tensors(config, seed, peaked=peaked, mask_id=mask_id, device=device):
        assign(name, tensor)
    assign.finish()
    return model, config
