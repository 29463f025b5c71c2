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

From PERSISTENT_ROWS rows, kernels named in FLUXLAB_PERSISTENT (by default both; "" none, device A/B runs) launch their
TMA tiles persistently: PROGRAMS_PER_SM programs an SM, each walking output tiles of the per-tile grid in turn. A tile
still sums the same K-chunks in the same order, so the same bits (GPU tests at 2048 rows; the interpreter's at every
row count). One H100, 2026-12-07 (benchmarks/device/gemm_tma.py, graph replays; docs/benchmarks.md): at 4096
rows Diffusion-Gemma's bf16 layer matmuls 22.8 -> 20.7 and 23.7 -> 21.7 ms a step, its FP8 GEMMs 21.7 -> 21.2, at
2048 rows LLaDA2.0-mini's FP8 GEMMs 1.66 -> 1.55; below 1024 rows it lost (FP8 at 32 rows 0.418 -> 0.433). One
program an SM lost everywhere (by 20-45%): two keep one tile's loads in flight under the other's MMAs, which the
per-tile grid gets from co-resident programs. Flattening the tile loop (`tl.range(..., flatten=True)`) lost at 256
rows and on the bf16 matmul (38.9 against 33.3 ms at 4096 rows), and warp specialization (`warp_specialize=True`)
timed as flattening alone on that H100: neither is used.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

GEMM_KERNELS = ("fp8_gemm", "matmul")


def _kernels_from_env(name: str) -> frozenset[str]:
    """The kernels an env var names, comma-separated, by default all of GEMM_KERNELS; a name not among them is
    refused (a typo would otherwise turn the path off silently)."""
    kernels = frozenset(k for k in os.environ.get(name, ",".join(GEMM_KERNELS)).split(",") if k)
    if kernels - set(GEMM_KERNELS):
        raise ValueError(f"{name}={os.environ[name]!r}: names {sorted(kernels - set(GEMM_KERNELS))}; "
                         f"the kernels are {', '.join(GEMM_KERNELS)} (comma-separated, '' for none)")
    return kernels


KERNELS = _kernels_from_env("FLUXLAB_TMA")
_scopes = 0  # how many `graph_tiles()` are open
PERSISTENT_KERNELS = _kernels_from_env("FLUXLAB_PERSISTENT")
PERSISTENT_ROWS, PROGRAMS_PER_SM = 1024, 2


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


def persistent(kernel: str, rows: int) -> bool:
    """Whether a `rows`-row product of `kernel` that takes TMA tiles launches them persistently (module doc)."""
    return rows >= PERSISTENT_ROWS and kernel in PERSISTENT_KERNELS


def programs(device: torch.device, tiles: int) -> int:
    """A persistent launch's grid: PROGRAMS_PER_SM programs an SM, no more than there are tiles."""
    return min(tiles, PROGRAMS_PER_SM * _sm_count(device.index if device.index is not None
                                                  else torch.cuda.current_device()))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fits(*tensors: torch.Tensor) -> bool:
    """TMA descriptors fit each 2-D tensor as laid out: an sm90+ GPU, unit last stride, a row stride and an address
    of whole 16 bytes."""
    return (tensors[0].is_cuda and torch.cuda.get_device_capability(tensors[0].device)[0] >= 9
            and all(t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
                    for t in tensors))
