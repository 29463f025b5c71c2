"""make_engine: the engine a validated run config asks for, chosen by the model's family (registry)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fluxlab.models.registry import family_of_model

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from fluxlab.engine.llm_engine import LLMEngine


def make_engine(cfg: DictConfig) -> LLMEngine:
    """The family's engine; tensor/expert parallel groups (parallel.tp_size > 1) start their workers
    when the family runs under the block engine's parallelism."""
    family = family_of_model(cfg.model)
    if cfg.parallel.tp_size > 1 and family.parallel:
        from fluxlab.engine.distributed.engine import ParallelEngine

        return ParallelEngine(cfg)
    return family.engine_class()(cfg)
