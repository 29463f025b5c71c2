"""Tile configs of the fused MoE (kernels/fused_moe.py): `MoEConfig`, and `default_config`, which picks one.

A table measured per GPU, expert shape and token count (`moe_configs/<GPU>.json`, written by
`python -m fluxlab.bench.moe_tune`), else a heuristic keyed on the average rows per expert (no autotune:
autotuning inside a CUDA-graph capture is unsafe; the config is picked from shapes at capture). The env
var FLUXLAB_FUSED_MOE_CONFIG='{"BLOCK_M":16,...}' (keys of `MoEConfig`) overrides fields for device sweeps.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from pathlib import Path

import torch


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    BLOCK_M: int = 16
    # kernel 1 (gate/up, N = I, K = H)
    BLOCK_N1: int = 64
    BLOCK_K1: int = 128
    WARPS1: int = 4
    STAGES1: int = 3
    # kernel 2 (down, N = H, K = I)
    BLOCK_N2: int = 64
    BLOCK_K2: int = 128
    WARPS2: int = 4
    STAGES2: int = 3
    GROUP_M: int = 8
    # Kernel 1 / kernel 2: a row tile whose rows fit in BLOCK_M / 2**s (s <= SHRINK, at least 16
    # rows) runs a GEMM of that height, so an expert's last tile skips most of its padding (at
    # 2048 tokens, BLOCK_M 128 multiplies ~2x the useful rows; ~1.5x with SHRINK 1).
    SHRINK1: int = 0
    SHRINK2: int = 0
    # Kernel 1 / kernel 2: 1 = weight tiles through a TMA tensor descriptor (sm90+) instead of
    # pointer loads (fewer registers and address instructions per tile).
    TMA1: int = 0
    TMA2: int = 0

    def __post_init__(self):
        for name in ("TMA1", "TMA2"):
            if getattr(self, name) not in (0, 1):
                raise ValueError(f"MoEConfig: {name}={getattr(self, name)}; {name} is 0 or 1")
        for name in ("SHRINK1", "SHRINK2"):
            shrink = getattr(self, name)
            if shrink not in (0, 1, 2) or self.BLOCK_M >> shrink < 16:
                raise ValueError(f"MoEConfig: {name}={shrink} with BLOCK_M={self.BLOCK_M}; {name} is 0, 1 or 2 and "
                                 f"BLOCK_M / 2**{name} must be at least 16 rows (the smallest tl.dot tile)")


def heuristic_config(num_slots: int, num_experts: int) -> MoEConfig:
    """The untuned fallback, keyed on the average rows per expert.

    Few rows per expert (decode, <= 16 on average): the layer streams weights, so BLOCK_M=16 (mma
    path), wide-K tiles and 3 stages keep ~100 KB of weight loads in flight per SM. More rows per
    expert: bigger M tiles so each weight strip is reused across more rows."""
    avg = num_slots / max(1, num_experts)
    if avg <= 16:
        return MoEConfig(BLOCK_M=16, BLOCK_N1=64, BLOCK_K1=128, WARPS1=4, STAGES1=3,
                         BLOCK_N2=64, BLOCK_K2=128, WARPS2=4, STAGES2=3, GROUP_M=8)
    if avg <= 48:
        return MoEConfig(BLOCK_M=32, BLOCK_N1=64, BLOCK_K1=128, WARPS1=4, STAGES1=3,
                         BLOCK_N2=64, BLOCK_K2=128, WARPS2=4, STAGES2=3, GROUP_M=8)
    return MoEConfig(BLOCK_M=64, BLOCK_N1=128, BLOCK_K1=64, WARPS1=8, STAGES1=3,
                     BLOCK_N2=128, BLOCK_K2=64, WARPS2=4, STAGES2=3, GROUP_M=8)


CONFIG_DIR = Path(__file__).resolve().parent / "moe_configs"


def shape_key(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype) -> str:
    return f"E={num_experts},H={hidden},I={inter},K={top_k},{str(dtype).removeprefix('torch.')}"


def device_table_path(device_name: str) -> Path:
    """moe_configs/<GPU name>.json, the name as torch reports it with non-alphanumerics as '_'."""
    return CONFIG_DIR / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


def _device_name(device: torch.device) -> str:
    return _device_name_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _device_name_of(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.lru_cache(maxsize=None)
def _load_table(device_name: str) -> dict:
    path = device_table_path(device_name)
    if not path.is_file():
        return {}
    return json.loads(path.read_text()).get("configs", {})


def tuned_config(num_tokens: int, shape: str, device_name: str) -> MoEConfig | None:
    """The measured config of the tuned token count nearest to num_tokens (log scale), if this
    GPU and expert shape have a table (written by `python -m fluxlab.bench.moe_tune`)."""
    entries = _load_table(device_name).get(shape)
    if not entries:
        return None
    nearest = min(entries, key=lambda t: abs(math.log2(int(t)) - math.log2(max(1, num_tokens))))
    fields = {f.name for f in dataclasses.fields(MoEConfig)}
    return MoEConfig(**{k: v for k, v in entries[nearest].items() if k in fields})


def default_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                   dtype: torch.dtype = torch.bfloat16, device: torch.device | None = None) -> MoEConfig:
    """The tuned table's config for this GPU and shape, else the heuristic; then the env override
    FLUXLAB_FUSED_MOE_CONFIG (a JSON object of MoEConfig fields)."""
    cfg = None
    if device is not None and device.type == "cuda":
        cfg = tuned_config(num_tokens, shape_key(num_experts, hidden, inter, top_k, dtype), _device_name(device))
    cfg = cfg or heuristic_config(num_tokens * top_k, num_experts)
    env = os.environ.get("FLUXLAB_FUSED_MOE_CONFIG")
    if env:
        cfg = dataclasses.replace(cfg, **json.loads(env))
    return cfg
