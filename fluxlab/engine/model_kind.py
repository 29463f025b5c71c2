"""Which model family a model config names, without loading torch (config validation reads it)."""
from __future__ import annotations

import json
from pathlib import Path

# model.preset values of Diffusion-Gemma (checkpoint_diffusion_gemma.py, presets_diffusion_gemma.py)
DIFFUSION_GEMMA_PRESETS = ("tiny_diffusion_gemma", "diffusion_gemma_26b_a4b")


def is_diffusion_gemma(model) -> bool:
    """model.path/config.json says model_type diffusion_gemma, or (no such file) model.preset is one."""
    if model.path is not None:
        config = Path(str(model.path)).expanduser() / "config.json"
        if config.is_file():
            return json.loads(config.read_text()).get("model_type") == "diffusion_gemma"
    return model.preset in DIFFUSION_GEMMA_PRESETS
