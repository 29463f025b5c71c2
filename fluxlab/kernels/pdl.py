"""Programmatic dependent launch (PDL, sm90+) for the Triton kernels: the next kernel in the stream starts while
this one finishes.

Inside a CUDA graph a small forward is a chain of ~400 short kernels (LLaDA2.0-mini's decode at batch 1, one
Diffusion-Gemma canvas), and each boundary costs the next grid's launch and ramp-up after the last block of the one
before. With PDL the next grid is launched once every block of the running one has started, and waits in
`griddepcontrol.wait` (`start`, each kernel's first statement) until that grid has completed and its memory is
visible: the same reads and writes in the same order, so the same bits, with the launch hidden behind the tail. A
kernel that is not PDL-launched (torch's, cuBLAS's) keeps the stream's full serialization on both sides.

On by default, at sm90+, for the kernels of a CUDA graph's forward of at most MAX_TOKENS tokens: the graph runners
(engine/graph_runner.py, models/diffusion_gemma/static.py) open `forward_of(tokens)` around their warm-up and capture.
Eager launches stay without it (not measured). FLUXLAB_PDL=0 turns it off (A/B runs: `launch()` is empty then, so
kernels compile and launch as without it). Never under the Triton interpreter (the CPU tests) or below sm90. One H100,
2026-12-07 (benchmarks/device/pdl.sh and diffusion_gemma_speed.sh; docs/benchmarks.md): LLaDA2.0-mini's fp8 decode
at batch 1 (32 tokens) 2.66 -> 2.49 ms, at batch 64 (2048) unchanged; Diffusion-Gemma's bf16 denoising step at one
canvas (256 tokens) 23.24 -> 22.62 ms, but at 16 canvases (4096) 96.6 -> 101.7 ms (likely the dependent grid's
blocks, parked in their wait, taking SM room the running grid's later waves want): hence the size cap. The same bits
with and without (tests/test_pdl.py; the GPU tests of the FP8, matmul and norm kernels with it on).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

HAVE_TRITON = importlib.util.find_spec("triton") is not None
ENABLED = os.environ.get("FLUXLAB_PDL", "1") != "0"
MAX_TOKENS = 1024  # a gain at 32 and 256 tokens, neutral at 2048, a loss at 4096
_open = {False: 0, True: 0}  # how many `forward_of` scopes are open, by whether their forward is above MAX_TOKENS

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def start(PDL: tl.constexpr):
        # before any read or write: the grid before this one has completed (its writes are visible, and its reads of
        # what this kernel writes are done); then the next grid may launch once all of this grid's blocks run
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
else:
    start = None


@contextlib.contextmanager
def forward_of(tokens: int):
    """Kernels launched inside belong to a graph's forward of `tokens` tokens: PDL up to MAX_TOKENS, and none inside
    a larger one's scope. Open it around a CUDA graph's warm-up and capture (the warm-up compiles the variant the
    capture records). Counters, not thread-local, as kernels/tma.py's graph_tiles: an eager call on another thread
    meanwhile launches as the open scopes say (time, never bits)."""
    large = tokens > MAX_TOKENS
    _open[large] += 1
    try:
        yield
    finally:
        _open[large] -= 1


def launch() -> dict:
    """Launch keywords for a kernel that calls `start(PDL)`: PDL on where enabled, the GPU has it and only scopes of
    small forwards are open, else none."""
    return {"PDL": True, "launch_pdl": True} if ENABLED and _open[False] and not _open[True] and _sm90() else {}


@functools.cache
def _sm90() -> bool:
    import torch

    return (os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] >= 9)
