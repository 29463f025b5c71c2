"""Programmatic dependent launch (fluxlab/kernels/pdl.py): every Triton kernel waits for the grid before it as its
first statement, every launch passes the PDL keywords, and (GPU) a chain of kernels gives the same bits with PDL on
as off, eagerly and replayed from a CUDA graph."""
import ast
import importlib.util
from pathlib import Path

import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
KERNELS = Path(__file__).resolve().parents[1] / "fluxlab" / "kernels"


def _is_jit(node: ast.FunctionDef) -> bool:
    return any((isinstance(d, ast.Attribute) and d.attr == "jit")
               or (isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "jit") for d in node.decorator_list)


def test_every_kernel_waits_first_and_every_launch_passes_the_pdl_keywords():
    """A kernel launched with PDL that read or wrote memory before `griddepcontrol.wait` would race the grid before
    it: so every entry kernel's first statement is pdl_start(PDL), and every launch in fluxlab passes pdl_launch()."""
    kernels, launches = [], []
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and _is_jit(node):
                names.add(node.name)
                first = ast.unparse(node.body[0])
                has_param = any(a.arg == "PDL" for a in node.args.args)
                kernels.append((f"{path.name}:{node.name}", has_param and first == "pdl_start(PDL)"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in names):
                passes = any(k.arg is None and ast.unparse(k.value) == "pdl_launch()" for k in node.keywords)
                launches.append((f"{path.name}:{node.lineno}", passes))
    assert len(kernels) >= 25 and len(launches) >= 25, (len(kernels), len(launches))
    assert [k for k, ok in kernels if not ok] == [], "kernels whose first statement is not pdl_start(PDL)"
    assert [site for site, ok in launches if not ok] == [], "launches without **pdl_launch()"


def test_pdl_is_off_without_an_sm90_gpu(monkeypatch):
    from fluxlab.kernels import pdl

    monkeypatch.setattr(pdl, "ENABLED", True)
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9):
        assert pdl.launch() == {}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch() == {}


def test_a_forward_of_more_than_max_tokens_launches_without_pdl(monkeypatch):
    """16 Diffusion-Gemma canvases (4096 tokens) lost 5% with PDL on an H100, one canvas and LLaDA's decode at batch 1
    gained: the graph runners' `forward_of` scope decides by the forward's size, and restores on leaving; eager
    launches outside any scope stay without it."""
    from fluxlab.kernels import pdl

    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "_sm90", lambda: True)
    on = {"PDL": True, "launch_pdl": True}
    assert pdl.launch() == {}
    with pdl.forward_of(pdl.MAX_TOKENS):
        assert pdl.launch() == on
        with pdl.forward_of(pdl.MAX_TOKENS + 1):
            assert pdl.launch() == {}
            with pdl.forward_of(32):
                assert pdl.launch() == {}  # inside a large forward's scope
        assert pdl.launch() == on
    with pytest.raises(RuntimeError), pdl.forward_of(4096):
        raise RuntimeError
    assert pdl.launch() == {}
    with pdl.forward_of(256):
        assert pdl.launch() == on


@pytest.mark.parametrize("value, enabled", [(None, True), ("1", True), ("0", False)])
def test_pdl_is_on_by_default_and_fluxlab_pdl_0_turns_it_off(value, enabled):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "FLUXLAB_PDL"} | ({"FLUXLAB_PDL": value} if value else {})
    out = subprocess.run([sys.executable, "-c", "from fluxlab.kernels import pdl; print(pdl.ENABLED)"], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(enabled)


def _chain(x: torch.Tensor, w: torch.Tensor, norm_w: torch.Tensor, fp8_w: tuple) -> torch.Tensor:
    from fluxlab.kernels.fp8_gemm import fp8_matmul
    from fluxlab.kernels.fused_norm import rms_norm
    from fluxlab.kernels.invariant_matmul import matmul
    from fluxlab.kernels.swiglu import silu_mul

    for _ in range(3):  # each kernel reads what the one before wrote
        h = rms_norm(x, norm_w, 1e-6)
        g = matmul(h, w)
        x = silu_mul(g[:, : g.shape[1] // 2], g[:, g.shape[1] // 2:])
        x = fp8_matmul(x, *fp8_w)
    return x


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU and triton")
def test_a_chain_of_kernels_gives_the_same_bits_with_pdl(monkeypatch):
    from fluxlab.engine.layers.fp8 import quantize_blocks
    from fluxlab.kernels import pdl

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 1024, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(4096, 1024, generator=gen, device="cuda") * 0.03).bfloat16()
    norm_w = torch.rand(1024, generator=gen, device="cuda").bfloat16() + 0.5
    fp8_w = quantize_blocks((torch.randn(1024, 2048, generator=gen, device="cuda") * 0.03).bfloat16())
    off = _chain(x, w, norm_w, fp8_w)  # eager, outside any forward_of scope: no PDL
    monkeypatch.setattr(pdl, "ENABLED", True)
    pdl._sm90.cache_clear()
    with pdl.forward_of(x.shape[0]):
        # PDL launches where the GPU has it (sm90+); below, launch() stays empty and the chain runs as without it
        assert bool(pdl.launch()) == (torch.cuda.get_device_capability()[0] >= 9)
        assert torch.equal(_chain(x, w, norm_w, fp8_w), off)
        static = x.clone()
        _chain(static, w, norm_w, fp8_w)  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(static, w, norm_w, fp8_w)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, off)
