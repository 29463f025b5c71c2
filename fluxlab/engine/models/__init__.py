from fluxlab.engine.models.llada2_moe import LLaDA2MoeConfig, LLaDA2MoeModel

__all__ = ["LLaDA2MoeConfig", "LLaDA2MoeModel"]
