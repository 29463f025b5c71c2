"""What the engine core asks the LLaDA2 family (LLaDA2.0/2.1 and 2.2): `Family.hooks()` returns this module.

A family decoded by the block engine (fluxlab/engine/llm_engine.py, and its tensor-parallel form) gives
it these six names; the engine never imports a family module itself.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from fluxlab.models.llada2.checkpoint import preset_checkpoint_config, write_checkpoint
from fluxlab.models.llada2.loader import build_random_model, load_model as load_weights, read_config
from fluxlab.models.llada2.model import LLaDA2MoeConfig, LLaDA2MoeModel, check_block_length, check_parallel
from fluxlab.models.llada2.special_ids import special_ids

__all__ = ["check_block_length", "check_parallel", "load_model", "model_config", "special_ids", "write_checkpoint"]


def load_model(model_cfg, device: torch.device, dtype: torch.dtype, model_dir: Optional[Path], seed: int):
    """(model, model_config): the checkpoint folder's weights, or random ones of model.preset's shapes
    (model.load_format=random). TP/EP workers build their shard with the same call.
    model.quantization=fp8: an FP8 checkpoint is read as it is, other weights are quantized at load
    (fluxlab/engine/layers/quantization.py)."""
    from fluxlab.engine.layers.quantization import fp8_checkpoint, fp8_structure_, fuse_shared_experts_, quantize_model_
    from fluxlab.models.llada2.fp8_checkpoint import load_fp8_weights

    fp8 = model_cfg.get("quantization", "none") == "fp8"
    if model_cfg.load_format != "random" and fp8_checkpoint(model_dir):
        if not fp8:
            raise ValueError(f"{model_dir} holds FP8 weights (config.json quantization_config): set "
                             "model.quantization=fp8 to run them")
        config = read_config(model_dir)
        model = fp8_structure_(LLaDA2MoeModel(config, dtype=dtype, device=device).eval())
        return fuse_shared_experts_(load_fp8_weights(model, model_dir)), config
    if model_cfg.load_format == "random":
        model, config = build_random_model(model_cfg.preset, dtype, device, seed=seed)
    else:
        model, config = load_weights(model_dir, dtype, device)
    return (fuse_shared_experts_(quantize_model_(model)) if fp8 else model), config


def model_config(model_dir: Optional[Path], preset: Optional[str]) -> LLaDA2MoeConfig:
    """The model's config without its weights (the parallel rules are checked before any process starts)."""
    if model_dir is not None:
        return read_config(model_dir)
    return LLaDA2MoeConfig.from_dict(preset_checkpoint_config(preset)[0])
