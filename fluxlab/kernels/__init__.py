"""Custom kernels (Triton). Importable without triton: check `fused_moe.HAVE_TRITON`."""
from fluxlab.kernels.fused_moe import HAVE_TRITON, MoEConfig, default_config, fused_moe, grouped_mm_moe, moe_align

__all__ = ["HAVE_TRITON", "MoEConfig", "default_config", "fused_moe", "grouped_mm_moe", "moe_align"]
