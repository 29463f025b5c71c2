"""kernels/tma.py: which GEMM kernels take TMA tiles, and only inside `graph_tiles()`."""
import os
import subprocess
import sys

import pytest
import torch


def test_kernels_take_tma_tiles_only_inside_graph_tiles(monkeypatch):
    from fluxlab.kernels import tma

    if "FLUXLAB_TMA" not in os.environ:
        assert tma.KERNELS == {"fp8_gemm", "matmul"}  # the default: both GEMM kernels
    monkeypatch.setattr(tma, "KERNELS", frozenset({"fp8_gemm"}))
    assert not tma.wanted("fp8_gemm")
    with tma.graph_tiles():
        with tma.graph_tiles():
            assert tma.wanted("fp8_gemm") and not tma.wanted("matmul")
        assert tma.wanted("fp8_gemm")
    assert not tma.wanted("fp8_gemm")
    with pytest.raises(RuntimeError), tma.graph_tiles():
        raise RuntimeError("a failed capture")
    assert not tma.wanted("fp8_gemm")  # the scope closes on an error too


def test_descriptors_never_fit_cpu_tensors():
    from fluxlab.kernels import tma

    assert not tma.fits(torch.zeros(4, 64), torch.zeros(8, 64))


def test_fluxlab_tma_names_the_kernels():
    code = "from fluxlab.kernels import tma; print(sorted(tma.KERNELS))"
    for value, want in (("", "[]"), ("fp8_gemm,matmul", "['fp8_gemm', 'matmul']"), ("matmul", "['matmul']")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "FLUXLAB_TMA": value}).stdout.strip()
        assert out == want, (value, out)


def test_fluxlab_persistent_names_kernels_from_1024_rows_and_a_typo_is_refused(monkeypatch):
    from fluxlab.kernels import tma

    if "FLUXLAB_PERSISTENT" not in os.environ:
        assert tma.PERSISTENT_KERNELS == {"fp8_gemm", "matmul"}  # the default: both GEMM kernels
    monkeypatch.setattr(tma, "PERSISTENT_KERNELS", frozenset({"matmul"}))
    assert [tma.persistent("matmul", rows) for rows in (1, 1023, 1024, 4096)] == [False, False, True, True]
    assert not tma.persistent("fp8_gemm", 4096)
    for name in ("FLUXLAB_PERSISTENT", "FLUXLAB_TMA"):
        monkeypatch.setenv(name, "matmul,fp8")
        with pytest.raises(ValueError, match=f"{name}='matmul,fp8': names \\['fp8'\\]"):
            tma._kernels_from_env(name)
        monkeypatch.setenv(name, "")
        assert tma._kernels_from_env(name) == frozenset()
