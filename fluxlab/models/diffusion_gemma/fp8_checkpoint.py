"""Diffusion-Gemma with model.quantization=fp8: which layers are e4m3, converting a model (quantize at
load, or empty FP8 layers to read an FP8 checkpoint into), and writing an FP8 checkpoint.

Quantized (DESIGN: the DeepSeek-V3 / Qwen3-FP8 layout, fluxlab/engine/layers/fp8.py): every text
layer's attention q/k/v/o projections, its dense MLP gate/up/down and its routed experts, in the
decoder's layers and, in an untied checkpoint, the encoder's own. Kept in the model dtype:
- the router (`router.proj`): its scores pick the experts, and an e4m3 rounding that swaps two
  close experts changes a token's whole MoE output, not a few per cent of it;
- norms, layer scalars, the router's scales: vectors, nothing to gain;
- the embedding, tied to the head and to the self-conditioning product (probs @ embedding), and an
  untied `lm_head`: the published FP8 convention keeps them, and the soft embedding is an average
  over 262144 rows that block scales would coarsen for every canvas token;
- the self-conditioning MLP: one MLP per canvas token against 30 layers' worth (18M of 26B
  weights: no measurable gain), and its input is the previous step's prediction fed back at every
  denoising step, so it stays exact.

The FP8 checkpoint keeps transformers' names (`model.decoder.layers.N.self_attn.q_proj.weight`,
`...experts.gate_up_proj`) with the e4m3 tensor under the name and its fp32 scales under the name
plus `_scale_inv`; config.json carries `quantization_config` (engine/layers/quantization.py). The
stacked gate_up_proj has one grid per half ([E, 2*ceil(I/128), ceil(H/128)]); transformers'
FineGrainedFP8 puts one grid over both halves, the same tensor when I is a multiple of 128 and
refused by the loader's shape check when it is not (the 26B-A4B's I = 704).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fluxlab.engine.layers.fp8 import quantize_blocks, quantize_stacked
from fluxlab.engine.layers.quantization import Fp8Linear, write_fp8_folder
from fluxlab.models.diffusion_gemma.layers import Fp8GemmaExperts

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def quantized_kind(name: str) -> str | None:
    """How a checkpoint tensor is stored in an FP8 checkpoint: "stacked" (gate_up_proj, a grid per
    half), "blocks" (a projection's weight, the experts' down_proj), None (kept in its dtype)."""
    if name.endswith(".experts.gate_up_proj"):
        return "stacked"
    if name.endswith(".experts.down_proj") or name.endswith(tuple(f".{p}.weight" for p in PROJECTIONS)):
        return "blocks"
    return None


def _text_layers(model: nn.Module) -> list[nn.Module]:
    return list(model.layers) + (list(model.encoder_layers) if model.encoder_layers is not None else [])


def _projections(layer: nn.Module):
    """(parent module, attribute) of a layer's quantized projections (full-attention layers have no v_proj)."""
    for path in PROJECTIONS:
        parent_name, attr = path.split(".")
        parent = getattr(layer, parent_name)
        if getattr(parent, attr) is not None:
            yield parent, attr


@torch.no_grad()
def quantize_diffusion_gemma_(model: nn.Module) -> nn.Module:
    """Quantize a loaded DiffusionGemmaModel's projections and experts in place, layer by layer (the
    high-precision weight of each is freed as it goes)."""
    for layer in _text_layers(model):
        for parent, attr in _projections(layer):
            setattr(parent, attr, Fp8Linear.quantized(getattr(parent, attr).weight.data))
        layer.experts = Fp8GemmaExperts.quantized(layer.experts)
    return model


def fp8_structure_(model: nn.Module) -> nn.Module:
    """Replace every quantized layer by its empty FP8 twin on the same device (an FP8 checkpoint loads into it)."""
    for layer in _text_layers(model):
        for parent, attr in _projections(layer):
            weight = getattr(parent, attr).weight
            setattr(parent, attr, Fp8Linear(*weight.shape, device=weight.device))
        e, two_i, h = layer.experts.gate_up_proj.shape
        layer.experts = Fp8GemmaExperts(e, h, two_i // 2, device=layer.experts.gate_up_proj.device)
    return model


def write_fp8_checkpoint(src, dst) -> Path:
    """A bf16/fp32 Diffusion-Gemma checkpoint folder -> the same model as an FP8 checkpoint (module doc);
    the other files (generation_config.json, tokenizer) are copied as they are."""
    def quantize(name: str, t: torch.Tensor):
        kind = quantized_kind(name)
        if kind is None:
            return None
        return quantize_stacked(t, 2) if kind == "stacked" else quantize_blocks(t)

    return write_fp8_folder(src, dst, quantize)
