"""TMA tiles under CUDA graphs: when the GEMM kernels load their tiles through tensor descriptors.

On sm90+ a GEMM may load its x and w tiles through TMA descriptors instead of pointer loads: the same products summed
in the same order, so the same bits, and under graph replay faster (docs/benchmarks.md, "TMA tiles for the FP8
GEMM"). Called eagerly, though, each launch encodes its descriptors on the host, which made small GEMMs host-bound
(2-6x slower at 32-256 rows on an H100). So a kernel takes TMA tiles only inside `graph_tiles()`, which the graph
runners (engine/graph_runner.py, models/diffusion_gemma/static.py) open around their warm-up and capture: the TMA
kernels compile in the warm-up, never inside a capture, and a replay reuses the descriptors captured once.

FLUXLAB_TMA names the kernels that may take them, by default both: "fp8_gemm" (kernels/fp8_gemm.py) and "matmul"
(kernels/invariant_matmul.py; on an H200 on 2026-12-07 it kept the bits and took Diffusion-Gemma's bf16 denoising step
at batch 16 from ~98 to ~95 ms, docs/benchmarks.md); "" none (device A/B runs).

FLUXLAB_PERSISTENT="matmul=ws,fp8_gemm=flat" (device A/B runs; default none) makes a kernel's TMA tiles run as a
persistent kernel: a program per SM walking output tiles in turn, `flat` letting the compiler pipeline the next tile's
loads under this tile's epilogue, `ws` splitting loads and MMAs into their own warps (Triton's warp specialization).
Each tile sums the same K-chunks in the same order: the same bits (benchmarks/device/gemm_persistent.py checks).
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

KERNELS = frozenset(k for k in os.environ.get("FLUXLAB_TMA", "fp8_gemm,matmul").split(",") if k)
_scopes = 0  # how many `graph_tiles()` are open
# variant -> (flatten the tile loop, warp-specialize it, programs per SM)
PERSISTENT_VARIANTS = {"plain": (False, False, 1), "flat": (True, False, 1), "ws": (True, True, 1),
                       "ws_noflat": (False, True, 1), "flat2": (True, False, 2)}


def _persistent_from_env(value: str) -> dict[str, tuple[bool, bool, int]]:
    chosen = {}
    for item in filter(None, value.split(",")):
        kernel, _, variant = item.partition("=")
        if kernel not in ("matmul", "fp8_gemm") or variant not in PERSISTENT_VARIANTS:
            raise ValueError(f"FLUXLAB_PERSISTENT: {item!r}; KERNEL=VARIANT with KERNEL matmul or fp8_gemm and "
                             f"VARIANT one of {sorted(PERSISTENT_VARIANTS)}")
        chosen[kernel] = PERSISTENT_VARIANTS[variant]
    return chosen


PERSISTENT = _persistent_from_env(os.environ.get("FLUXLAB_PERSISTENT", ""))


@contextlib.contextmanager
def graph_tiles():
    """Kernels named in KERNELS take TMA tiles inside (where `fits`): open it around a CUDA graph's warm-up and
    capture. A counter, not thread-local: an eager call on another thread meanwhile takes TMA too (host time,
    never bits)."""
    global _scopes
    _scopes += 1
    try:
        yield
    finally:
        _scopes -= 1


def wanted(kernel: str) -> bool:
    """Whether `kernel` should take TMA tiles now: inside `graph_tiles()` and named in FLUXLAB_TMA."""
    return _scopes > 0 and kernel in KERNELS


def persistent(kernel: str) -> tuple[bool, bool, int] | None:
    """(flatten, warp_specialize, programs per SM) where FLUXLAB_PERSISTENT names `kernel`, else None."""
    return PERSISTENT.get(kernel)


def programs(device: torch.device, per_sm: int, tiles: int) -> int:
    """A persistent kernel's grid: `per_sm` programs per SM, no more than there are tiles."""
    return min(tiles, per_sm * _sm_count(device.index if device.index is not None else torch.cuda.current_device()))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fits(*tensors: torch.Tensor) -> bool:
    """TMA descriptors fit each 2-D tensor as laid out: an sm90+ GPU, unit last stride, a row stride and an address
    of whole 16 bytes."""
    return (tensors[0].is_cuda and torch.cuda.get_device_capability(tensors[0].device)[0] >= 9
            and all(t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
                    for t in tensors))
