"""Programmatic dependent launch (PDL, sm90+) for the Triton kernels: the next kernel in the stream starts while
this one finishes.

Inside a CUDA graph a small forward is a chain of ~400 short kernels (LLaDA2.0-mini's decode at batch 1, one
Diffusion-Gemma canvas), and each boundary costs the next grid's launch and ramp-up after the last block of the one
before. With PDL the next grid is launched once every block of the running one has started, and waits in
`griddepcontrol.wait` (`start`, each kernel's first statement) until that grid has completed and its memory is
visible: the same reads and writes in the same order, so the same bits, with the launch hidden behind the tail. A
kernel that is not PDL-launched (torch's, cuBLAS's) keeps the stream's full serialization on both sides.

Off unless FLUXLAB_PDL=1 (device A/B runs; `launch()` is empty then, so kernels compile and launch as before) and
never under the Triton interpreter (the CPU tests) or below sm90. Not yet measured on a GPU.
"""
from __future__ import annotations

import functools
import importlib.util
import os

HAVE_TRITON = importlib.util.find_spec("triton") is not None
ENABLED = os.environ.get("FLUXLAB_PDL", "0") == "1"

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


def launch() -> dict:
    """Launch keywords for a kernel that calls `start(PDL)`: PDL on where enabled and the GPU has it, else none."""
    return {"PDL": True, "launch_pdl": True} if ENABLED and _sm90() else {}


@functools.cache
def _sm90() -> bool:
    import torch

    return (os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] >= 9)
