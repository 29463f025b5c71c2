"""What the rest of fluxlab asks the Diffusion-Gemma family: `Family.hooks()` returns this module.

Its engine (engine.py, the canvas engine) loads its own model; the checkpoint command asks for the writer,
the server for the checkpoint's own knob values (its defaults and work ceilings).
"""
from __future__ import annotations

from pathlib import Path

from fluxlab.models.diffusion_gemma.checkpoint import PRESET, write_diffusion_gemma_checkpoint

__all__ = ["generation_defaults", "write_checkpoint"]


def write_checkpoint(preset: str, out, seed: int = 0, dtype: str = "float32") -> Path:
    """The tiny Diffusion-Gemma checkpoint, written by transformers' own classes (checkpoint.py)."""
    if preset != PRESET:
        raise ValueError(f"preset={preset}: fluxlab writes only the {PRESET} checkpoint of Diffusion-Gemma "
                         f"(the published shapes run with model.load_format=random)")
    return write_diffusion_gemma_checkpoint(out, seed=seed, dtype=dtype)


def generation_defaults(model_cfg) -> dict:
    """The checkpoint's own canvas knob values (generation_config.json): the defaults, and so the work
    ceilings, of the engine that serves it (CanvasEngine.generation_defaults)."""
    from fluxlab.models.diffusion_gemma.decoding import read_generation_defaults
    from fluxlab.models.diffusion_gemma.engine import canvas_model_dir

    try:
        model_dir = canvas_model_dir(model_cfg)
    except ValueError:
        model_dir = None  # the engine refuses the path; transformers' defaults meanwhile
    return read_generation_defaults(model_dir)
