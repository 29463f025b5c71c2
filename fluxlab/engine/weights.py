"""Family-free weight helpers: dtype names, a checkpoint folder's safetensors files, and the
machine-independent random values every family's random weights are drawn from."""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [path / f for f in files]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights found in {path}")
    return files


def _seed_for(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**62)


def uniform_tensor(shape, std: float, seed: int, name: str, device=None) -> torch.Tensor:
    """Zero-mean uniform values with the given std, fp32, bit-identical on every machine.

    Integer draws from torch's mt19937 converted exactly to float, times a constant: no
    SIMD-dependent transcendental math (torch's normal_ has AVX2 and scalar paths).
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    g = torch.Generator(device=device)
    g.manual_seed(_seed_for(seed, name))
    ints = torch.randint(-(2**23), 2**23, tuple(shape), generator=g, device=device, dtype=torch.int32)
    return ints.to(torch.float32) * (std * math.sqrt(3.0) / 2**23)
