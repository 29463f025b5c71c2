"""What an engine loads before it runs: the checkpoint folder, the tokenizer and the model's weights
(the family's loader, routed experts on engine.moe_backend). Rank 0 and TP workers call the same functions."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from fluxlab.models.registry import family_of_model

if TYPE_CHECKING:  # the engine runs on a bare torch machine: no hydra/omegaconf import at run time
    from omegaconf import DictConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_dir(model_cfg: DictConfig) -> Optional[Path]:
    """The checkpoint folder to read config/tokenizer (and weights) from; None for random weights
    of a real preset whose files are not on this machine."""
    from fluxlab.checkpoint import ensure_tiny_checkpoint
    from fluxlab.models.registry import TINY_PRESETS

    if model_cfg.path is None:
        if model_cfg.preset in TINY_PRESETS:
            return ensure_tiny_checkpoint(preset=model_cfg.preset)
        if model_cfg.load_format == "random":
            return None
        raise ValueError(f"model.path is not set for model={model_cfg.name}")
    path = Path(model_cfg.path).expanduser()
    if path.is_dir():
        return path
    if model_cfg.load_format == "random":
        return None
    raise ValueError(f"model.path={model_cfg.path!r} is not a local directory. fluxlab does not download "
                     "weights: download them and set model.path=DIR, or use model.load_format=random "
                     "(random weights of the preset's shapes) for speed work")


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def load_tokenizer(model_dir: Optional[Path], trust_remote_code: bool = False):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from fluxlab.checkpoint import ensure_tiny_checkpoint

    # Random real-preset weights have no tokenizer of their own: the tiny one's ids are all in range.
    source = model_dir if model_dir is not None else ensure_tiny_checkpoint()
    # model.trust_remote_code governs the tokenizer's own code in the checkpoint folder (its
    # tokenizer_config.json auto_map); the model class is always fluxlab's, never remote code.
    hf_logging.set_verbosity_error()
    return AutoTokenizer.from_pretrained(str(source), local_files_only=True, trust_remote_code=trust_remote_code)


def load_engine_model(cfg: DictConfig, device: torch.device, dtype: torch.dtype, model_dir: Optional[Path]):
    """(model, model_config): the checkpoint's weights (or the preset's random ones) on `device`, read by
    the model's family, routed experts on engine.moe_backend. TP workers build their shard with the same call."""
    from fluxlab.engine.layers.moe import StackedExperts

    family = family_of_model(cfg.model).hooks()
    model, model_config = family.load_model(cfg.model, device, dtype, model_dir, seed=cfg.engine.seed)
    moe_backend = cfg.engine.moe_backend
    if moe_backend == "auto":
        # Measured on H200 (docs/benchmarks.md): the Triton kernel is ~2x torch._grouped_mm.
        moe_backend = "triton" if device.type == "cuda" and _has_triton() else "grouped_mm"
    for module in model.modules():
        if isinstance(module, StackedExperts):
            module.backend = moe_backend
    return model, model_config
