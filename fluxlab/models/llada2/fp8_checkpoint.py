"""LLaDA2 FP8 checkpoints in the DeepSeek/Qwen3 block-scaled layout: which official tensors are e4m3
(with `<name>_scale_inv` beside them), reading such a folder into an FP8 model, writing one from a
bf16/fp32 folder. The FP8 modules and the quantizer are the core's (engine/layers/quantization.py)."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fluxlab.engine.layers.fp8 import quantize_blocks
from fluxlab.engine.layers.quantization import write_fp8_folder
from fluxlab.engine.weights import safetensor_files
from fluxlab.models.llada2.loader import _Assigner


def is_quantized_name(name: str) -> bool:
    """Whether an official LLaDA2 tensor name is stored as FP8 in an FP8 checkpoint."""
    return name.endswith(("_proj.weight", "attention.query_key_value.weight", "attention.dense.weight"))


@torch.no_grad()
def load_fp8_weights(model: nn.Module, path) -> nn.Module:
    """An FP8 checkpoint folder's tensors into a model converted by `fp8_structure_` (LLaDA2 names).

    `X.weight_scale_inv` goes to the scale beside X's e4m3 weight (for an expert, into its expert's
    rows of the stacked scales); every other tensor through the family's loader checks."""
    from safetensors import safe_open


    assign = _Assigner(model)
    params = dict(model.named_parameters())
    scales_seen = set()
    for file in safetensor_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if not name.endswith(".weight_scale_inv"):
                    assign(name, tuple(f.get_slice(name).get_shape()), lambda index, name=name: f.get_tensor(name))
                    continue
                weight_name = name.removesuffix("_scale_inv")
                slot = assign.layout.get(weight_name)
                if slot is None or not is_quantized_name(weight_name):
                    raise ValueError(f"unexpected tensor {name!r} in FP8 checkpoint")
                s = f.get_tensor(name).float()
                if slot.index is None:   # a projection: its module's weight_scale_inv
                    target = params[slot.param + "_scale_inv"]
                else:                    # an expert piece: rows of the stacked scales
                    e = slot.index[0]
                    stacked = params[slot.param + "_scale_inv"]
                    if slot.param.endswith("w_gate_up"):
                        nb = stacked.shape[1] // 2
                        rows = slice(nb, 2 * nb) if weight_name.endswith("up_proj.weight") else slice(0, nb)
                        target = stacked[e, rows]
                    else:
                        target = stacked[e]
                if tuple(target.shape) != tuple(s.shape):
                    raise ValueError(f"tensor {name!r} has shape {tuple(s.shape)}, expected {tuple(target.shape)}")
                target.copy_(s.to(target.device))
                scales_seen.add(weight_name)
    assign.finish()
    missing = [n for n in assign.layout if is_quantized_name(n) and n not in scales_seen]
    if missing:
        raise ValueError(f"FP8 checkpoint is missing tensor {missing[0] + '_scale_inv'!r}")
    return model


def write_fp8_checkpoint(src, dst) -> Path:
    """A bf16/fp32 LLaDA2 checkpoint folder -> the same model as an FP8 checkpoint (DeepSeek layout)."""
    return write_fp8_folder(src, dst, lambda name, t: quantize_blocks(t) if is_quantized_name(name) else None)
