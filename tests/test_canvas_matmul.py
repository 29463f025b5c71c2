"""The batch-invariant matmul Diffusion-Gemma's bf16 linears run (fluxlab/kernels/invariant_matmul.py)
against F.linear, and a row's bits alone vs among other rows.

CPU: under the Triton interpreter (TRITON_INTERPRET=1) in a subprocess (tests/triton_helpers.py),
fp32 with IEEE dots. GPU (`-m gpu`): 26B-A4B shapes in bf16, including the 262144-long reduction
of the self-conditioning input (split into a fixed number of K-slices).
"""
import importlib.util

import pytest
import torch
from triton_helpers import run_interpreter_checks

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def check(m: int, k: int, n: int, dtype, device, gen, transposed: bool = False, rows=(1, 3)) -> None:
    from fluxlab.kernels.invariant_matmul import matmul

    x = torch.randn(max(rows) * m, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(k, n, generator=gen, device=device).to(dtype).t() if transposed
         else torch.randn(n, k, generator=gen, device=device).to(dtype))
    got = matmul(x, w)
    want = torch.nn.functional.linear(x.double(), w.double())
    err = (got.double() - want).norm() / want.norm()
    assert err < (1e-6 if dtype == torch.float32 else 1e-2), (m, k, n, dtype, err.item())
    firsts = [matmul(x[:r * m], w)[:m] for r in rows]
    assert all(torch.equal(firsts[0], f) for f in firsts[1:]), (m, k, n)


def _interpreter_checks() -> None:
    gen = torch.Generator().manual_seed(0)
    check(5, 70, 33, torch.float32, "cpu", gen)  # ragged tiles and K tail
    check(130, 64, 130, torch.float32, "cpu", gen, rows=(1, 2))  # several row and column tiles
    import fluxlab.kernels.invariant_matmul as im

    im.SMALL_ROWS, im.SMALL_TILES[(33, 70)] = 8, (64, 16, 4, 1)  # 5 rows on small tiles, 15 on the default
    check(5, 70, 33, torch.float32, "cpu", gen)

    im.SLICE_K = 256  # a long reduction at interpreter speed: K = 700 -> 3 slices
    check(3, 700, 17, torch.float32, "cpu", gen, transposed=True)  # split K, a [K, N] view

    # TMA tiles (descriptor loads, which the interpreter runs too) inside graph_tiles(): the pointer loads' bits with
    # ragged row and column tiles, a K tail, split K and a [K, N] view; outside, pointer loads
    from fluxlab.kernels import tma

    real, kernels, asked, programs = tma.fits, tma.KERNELS, [], tma.programs
    tma.KERNELS = kernels | {"matmul"}
    tma.fits = lambda *tensors: asked.append(1) or True  # the CPU has no TMA: take the path regardless
    tma.programs = lambda device, tiles: min(tiles, 2)  # no SMs to count: two programs walk the tiles
    try:
        for m, k, n, transposed in [(5, 68, 33, False), (130, 64, 130, False), (3, 700, 20, True)]:
            x = torch.randn(m, k, generator=gen)
            w = torch.randn(k, n, generator=gen).t() if transposed else torch.randn(n, k, generator=gen)
            pointers = im.matmul(x, w)
            assert not asked
            with tma.graph_tiles():
                assert torch.equal(im.matmul(x, w), pointers), (m, k, n)
                # a persistent launch (tma.persistent: from 1024 rows on a GPU; one K-slice only): the same tiles,
                # the same bits
                assert torch.equal(im.matmul(x, w, tiles=(*im.tile_for(m, n, k), 1, True)), pointers), (m, k, n)
            assert asked == [1, 1]
            asked.clear()
    finally:
        tma.fits, tma.KERNELS, tma.programs = real, kernels, programs
    print("interpreter checks ok")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed (the CPU check runs it under TRITON_INTERPRET=1)")
def test_invariant_matmul_matches_linear_interpreter():
    run_interpreter_checks(__file__)


def test_every_tile_has_64_rows_or_more():
    """Row-count tiles keep a row's bits only on 64+-row tiles (module doc): 32-row tiles changed bits in
    the canvas attention's H200 sweep."""
    import fluxlab.kernels.invariant_matmul as im

    tiles = [im.DEFAULT_TILE, *im.SMALL_TILES.values(), *im.LARGE_TILES.values()]
    assert len(tiles) > 2 and all(block_m >= 64 for block_m, *_ in tiles), tiles


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU and triton")
def test_invariant_matmul_on_26b_shapes():
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k, n in ((2816, 4096), (4096, 2816), (2816, 128), (2112, 2816), (2816, 2112), (2816, 8192),
                 (8192, 2816), (2816, 9216), (2816, 4224)):  # the last three: fused q/k/v, full q/k, gate/up
        check(256, k, n, torch.bfloat16, "cuda", gen, rows=(1, 8, 64))
    check(256, 2816, 262144, torch.bfloat16, "cuda", gen, rows=(1, 4))  # the head
    check(256, 262144, 2816, torch.bfloat16, "cuda", gen, transposed=True, rows=(1, 4))  # self-conditioning
    # the slices' sum at 16 canvases (16 fp32 slices of 4096 x 2816)
    check(4096, 262144, 2816, torch.bfloat16, "cuda", gen, transposed=True, rows=(1,))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("k,n,transposed", [(2816, 8192, False), (4096, 2816, False), (2816, 128, False),
                                            (2112, 2816, False), (262144, 2816, True)])
def test_invariant_matmul_in_a_graph_takes_tma_tiles_with_the_eager_bits(k, n, transposed, monkeypatch):
    """Inside graph_tiles() (a graph's warm-up and capture) the matmul loads its tiles through TMA descriptors on
    sm90+ (pointer loads on older GPUs): warm-up and captured rows equal the eager (pointer-load) rows at 26B shapes,
    small and default tiles, and the self-conditioning product's 16 K-slices over the embedding seen as [K, N]."""
    from fluxlab.kernels import tma
    from fluxlab.kernels.invariant_matmul import matmul

    sm90 = torch.cuda.get_device_capability()[0] >= 9  # TMA where the GPU has it, else pointer loads: same bits
    monkeypatch.setattr(tma, "KERNELS", tma.KERNELS | {"matmul"})
    real, scoped = tma.fits, []

    def spy(*tensors):  # asked only inside graph_tiles()
        scoped.append(real(*tensors))
        return scoped[-1]
    monkeypatch.setattr(tma, "fits", spy)
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.randn(k, n, generator=gen, device="cuda").bfloat16().t() if transposed
         else torch.randn(n, k, generator=gen, device="cuda").bfloat16())
    row_counts = (1, 256) if transposed else (1, 7, 256, 2048)
    x = torch.randn(max(row_counts), k, generator=gen, device="cuda").bfloat16()
    full = matmul(x, w)  # eager: pointer loads
    assert not scoped
    for rows in row_counts:
        xs = x[:rows].clone()
        with tma.graph_tiles():
            warm = matmul(xs, w)  # compiles the TMA kernel outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = matmul(xs, w)
        graph.replay()
        assert torch.equal(warm, full[:rows]) and torch.equal(out, full[:rows]), rows
    assert scoped == [sm90] * 2 * len(row_counts)


if __name__ == "__main__":
    _interpreter_checks()
