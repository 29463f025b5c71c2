"""What the engine core asks the SDAR family (SDAR / TraDo, dense `sdar` and MoE `sdar_moe`): `Family.hooks()`
returns this module. The block engine decodes it (fluxlab/engine/llm_engine.py) with the decoders of SDAR's
published routines (fluxlab/models/sdar/low_confidence.py, bd3.py; docs/models.md, SDAR).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from fluxlab.engine.special_ids import SpecialIds, as_ids
from fluxlab.models.sdar.checkpoint import write_sdar_checkpoint
from fluxlab.models.sdar.loader import build_random_model, load_model as load_weights, read_config
from fluxlab.models.sdar.model import SDARConfig, check_parallel
from fluxlab.models.sdar.presets import EOS_TOKEN_ID, MASK_TOKEN_ID, PRESETS, preset_config

__all__ = ["check_block_length", "check_parallel", "load_model", "model_config", "special_ids", "write_checkpoint"]


def _json(path: Path) -> Optional[dict]:
    return json.loads(path.read_text()) if path.is_file() else None


def _folder(model_dir) -> Optional[Path]:
    # None (random weights of a published preset) reads no files: Path("") would be the cwd.
    return Path(model_dir) if model_dir and Path(model_dir).is_dir() else None


def load_model(model_cfg, device: torch.device, dtype: torch.dtype, model_dir: Optional[Path], seed: int):
    """(model, model_config): the checkpoint folder's weights, or random ones (model.load_format=random) of the
    folder's config (a tiny preset's cached folder) or of model.preset's published shapes."""
    if model_cfg.load_format == "random":
        folder = _folder(model_dir)
        config = read_config(folder) if folder is not None else SDARConfig.from_dict(preset_config(model_cfg.preset))
        return build_random_model(config, dtype, device, seed=seed)
    return load_weights(model_dir, dtype, device, progress=False)


def model_config(model_dir: Optional[Path], preset: Optional[str]) -> SDARConfig:
    """The model's config without its weights."""
    folder = _folder(model_dir)
    if folder is not None:
        return read_config(folder)
    return SDARConfig.from_dict({**preset_config(preset), "vocab_size": preset_config(preset)["vocab_size"] or 1})


def check_block_length(c: SDARConfig, block_length: int) -> None:
    """Any block length runs (attention is block-causal at whatever length the run sets); the checkpoints were
    trained with config.json's block_size (4 for the published SDAR models), the published routines' default."""


def _mask_from_tokenizer(folder: Path) -> Optional[int]:
    """The tokenizer's mask token (what generate.py reads: tokenizer.mask_token), from its JSON files."""
    tc, tj = _json(folder / "tokenizer_config.json"), _json(folder / "tokenizer.json")
    if not tc or not tj:
        return None
    token = tc.get("mask_token")
    token = token.get("content") if isinstance(token, dict) else token
    ids = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    return ids.get(token)


def special_ids(model_dir, preset: str | None = None) -> SpecialIds:
    """mask: config.json mask_token_id, else the tokenizer's mask token, else SDAR's <|MASK|> (151669); stop ids:
    generation_config.json eos_token_id (an int or a list: the set both published routines stop on), else
    config.json eos_token_id, else <|endoftext|> (151643); pad: config.json pad_token_id, else eos."""
    folder = _folder(model_dir)
    config = (_json(folder / "config.json") if folder else None) or (PRESETS.get(preset) if preset else None) or {}
    generation = (_json(folder / "generation_config.json") if folder else None) or {}
    mask = config.get("mask_token_id")
    if mask is None and folder is not None:
        mask = _mask_from_tokenizer(folder)
    stops = as_ids(generation.get("eos_token_id")) or as_ids(config.get("eos_token_id")) or [EOS_TOKEN_ID]
    pad = config.get("pad_token_id")
    return SpecialIds(MASK_TOKEN_ID if mask is None else int(mask), stops[0], stops[0] if pad is None else int(pad),
                      tuple(dict.fromkeys(stops)))


def write_checkpoint(preset: str, out, seed: int = 0, dtype: str = "float32") -> Path:
    return write_sdar_checkpoint(preset, out, seed=seed, dtype=dtype)
