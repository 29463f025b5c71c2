"""Diffusion-Gemma canvas attention alone, one layer of each type at 26B-A4B shapes (one H200): torch sdpa over
gathered keys + masks (PagedCanvasAttention, today's path) vs kernels/canvas_attention.py, and the kernel's tile
configs (BLOCK_M, BLOCK_N, warps, stages) by head dim, each checked bit for bit against the default config. Rows denoise a canvas of 256 over `prefix` cached keys
(the bench's second canvas: 256 prompt + 256 committed = 512). Also the per-forward metadata (masks or not).

    python benchmarks/device/diffusion_gemma_attention_tiles.py OUT.json [--prefix 512]

Prints a table; every number to OUT.json. A config's max |kernel - sdpa| is printed beside its time (tiles change
the summation order, so values move within bf16 rounding; pick one config a head dim, never per batch).
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch

import fluxlab.kernels.canvas_attention as ca
from fluxlab.models.diffusion_gemma.paged_attention import (CanvasKVCache, CanvasRow, PagedCanvasAttention,
                                                            build_canvas_metadata)

L, WINDOW, HEADS = 256, 1024, 16
LAYERS = {"sliding": (8, 256, True), "full": (2, 512, False)}  # KV heads, head dim, sliding
# the default's BLOCK_N first: a query tile of other rows (BLOCK_M) walks the same key blocks, so its bits
# should equal the default's ('same' column); another BLOCK_N sums in another order
CANDIDATES = {256: [(64, 64, 8, 2), (32, 64, 4, 2), (32, 64, 8, 2), (16, 64, 4, 2), (64, 64, 4, 2), (64, 64, 8, 3),
                    (128, 64, 8, 2), (64, 32, 4, 2)],
              512: [(64, 32, 8, 2), (32, 32, 4, 2), (32, 32, 8, 2), (16, 32, 4, 2), (64, 32, 8, 1), (32, 64, 8, 2)]}


def time_ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def setup(batch: int, prefix: int, kv_heads: int, head_dim: int, sliding: bool):
    pages = batch * (-(-prefix // L)) + 1
    cache = CanvasKVCache([(kv_heads, head_dim)], [sliding], pages, pages, L, torch.bfloat16, torch.device("cuda"))
    cache.k[0].normal_()
    cache.v[0].normal_()
    none = np.zeros(0, dtype=np.int64)
    rows = [CanvasRow(np.arange(r * prefix, (r + 1) * prefix), none, r * L + np.arange(L),
                      np.arange(r * prefix, (r + 1) * prefix), none) for r in range(batch)]
    q = torch.randn(batch * L, HEADS, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch * L, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch * L, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    return cache, rows, q, k, v


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--batches", default="1,16")
    args = parser.parse_args()
    results = []
    print(f"{'batch':>5} {'layer':>8} {'what':>22} {'ms':>8} {'max|d|':>9} {'same':>5}")
    for batch in [int(b) for b in args.batches.split(",")]:
        for name, (kv_heads, head_dim, sliding) in LAYERS.items():
            cache, rows, q, k, v = setup(batch, args.prefix, kv_heads, head_dim, sliding)
            device = torch.device("cuda")
            for masks in (True, False):
                ms = time_ms(lambda: build_canvas_metadata(rows, L, WINDOW, device, masks=masks))
                results.append(dict(batch=batch, layer=name, what=f"metadata masks={masks}", ms=ms))
            sdpa = PagedCanvasAttention(cache, [sliding], kernel=False)
            sdpa.begin(build_canvas_metadata(rows, L, WINDOW, device))
            want = sdpa.forward(0, q, k, v)
            ms = time_ms(lambda: sdpa.forward(0, q, k, v))
            results.append(dict(batch=batch, layer=name, what="sdpa", ms=ms, err=0.0))
            kernel = PagedCanvasAttention(cache, [sliding], kernel=True)
            kernel.begin(build_canvas_metadata(rows, L, WINDOW, device, masks=False))
            default = ca.CONFIGS[head_dim]
            reference = kernel.forward(0, q, k, v).clone()
            for config in CANDIDATES[head_dim]:
                ca.CONFIGS[head_dim] = config
                try:
                    got = kernel.forward(0, q, k, v)
                    err, same = (got.float() - want.float()).abs().max().item(), torch.equal(got, reference)
                    ms = time_ms(lambda: kernel.forward(0, q, k, v))
                except Exception as e:  # noqa: BLE001 - a config out of registers / shared memory
                    err, ms, same = float("nan"), float("nan"), None
                    print(f"  {config}: {type(e).__name__}: {str(e)[:120]}")
                tag = "kernel " + ",".join(map(str, config)) + (" *" if config == default else "")
                results.append(dict(batch=batch, layer=name, what=tag, ms=ms, err=err, same=same))
            ca.CONFIGS[head_dim] = default
            for r in results:
                if r["batch"] == batch and r["layer"] == name:
                    print(f"{batch:>5} {name:>8} {r['what']:>22} {r['ms']:>8.3f} {r.get('err', float('nan')):>9.2e} {str(r.get('same', '')):>5}")
    with open(args.out, "w") as f:
        json.dump(dict(prefix=args.prefix, window=WINDOW, canvas=L, heads=HEADS, results=results), f, indent=1)
    print("(* = the default config; a step runs 25 sliding and 5 full layers)")


if __name__ == "__main__":
    main()
