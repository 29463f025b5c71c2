"""fluxlab: serving engine and benchmark harness for block-diffusion language models (LLaDA2)."""
from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy so `python -m fluxlab --help` and config code never import torch.
    if name == "LLM":
        from fluxlab.llm import LLM

        return LLM
    if name == "SamplingParams":
        from fluxlab.engine.request import SamplingParams

        return SamplingParams
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
