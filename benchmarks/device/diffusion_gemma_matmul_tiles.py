"""Tile sweep of the batch-invariant matmul (fluxlab/kernels/invariant_matmul.py) at 26B-A4B shapes (GPU).

For each weight shape a denoising step multiplies by (per step: 25 sliding + 5 full layers, the
self-conditioning MLP, the head), times each tile config at 256 rows (batch 1) and 4096 (batch 16;
env ROWS=256,512,... for others) with triton's do_bench (median, L2 flushed), and checks whether the config's output equals the
default config's bit for bit (invariant_matmul.tile_for picks by weight shape and row count: every
config must give the default's bits).
Prints a table per shape and the step's total ms per config, then the best config per shape (by
256 + 4096-row time). `--fp8`: the same for the FP8 GEMM (kernels/fp8_gemm.py, e4m3 weights with 128x128
block scales, BLOCK_K = 128) at model.quantization=fp8's shapes (q/k/v fused, gate and up apart; the head and
the self-conditioning product stay bf16), for a row-count tile table there; SHAPESET=llada with --fp8: LLaDA2.0-mini's
FP8 GEMMs at 32 and 2048 rows.
Usage: python3 benchmarks/device/diffusion_gemma_matmul_tiles.py [--fp8] [out.json]
"""
import json
import os
import sys

import torch
import triton
from triton.testing import do_bench

import fluxlab.kernels.invariant_matmul as im
from fluxlab.engine.layers.fp8 import quantize_blocks
from fluxlab.kernels.fp8_gemm import fp8_matmul

# (N, K): count per step, in the engine's layout (model.fuse_projections_): a sliding layer's q, k, v as one
# 8192-row weight (4096 + 2 x 2048), a full layer's q and k (k = v) as 9216 (8192 + 1024), each layer's dense
# gate and up as 4224; the self-conditioning MLP keeps its two 2112-row weights
SHAPES = {(8192, 2816): 25, (9216, 2816): 5, (2816, 4096): 25, (2816, 8192): 5, (4224, 2816): 30,
          (2112, 2816): 2, (2816, 2112): 31, (128, 2816): 30, (262144, 2816): 1}
CONFIGS = {"default": (128, 128, 64, 8, 3), "64x128": (64, 128, 64, 4, 4), "128x64": (128, 64, 64, 4, 4),
           "64x64": (64, 64, 64, 4, 4), "128x256": (128, 256, 64, 8, 3), "128x128k128": (128, 128, 128, 8, 3),
           "128x128s4": (128, 128, 64, 8, 4), "64x32": (64, 32, 64, 4, 4),
           # TMA descriptors as inside a graph (kernels/tma.py), and Triton's warp specialization of the K loop
           # (a TMA producer warp beside the 4-warp MMA group; sm90 compiles it for 4-warp tiles, triton 3.6)
           "64x64 tma": (64, 64, 64, 4, 4, True), "64x64 ws": (64, 64, 64, 4, 4, True, True),
           "64x128 tma": (64, 128, 64, 4, 4, True), "64x128 ws": (64, 128, 64, 4, 4, True, True),
           "64x32 ws": (64, 32, 64, 4, 4, True, True), "128x128w4 ws": (128, 128, 64, 4, 3, True, True),
           # one canvas's 256 rows in one row tile: each weight tile read once (sm90 offline: no spills)
           "256x32 tma": (256, 32, 64, 8, 4, True), "256x64 tma": (256, 64, 64, 8, 3, True),
           "128x32 tma": (128, 32, 64, 4, 4, True),
           "cublas": None}  # torch's x @ w.T: not batch-invariant (split-K by rows); the headroom, never "best"
ROWS = tuple(int(r) for r in os.environ.get("ROWS", "256,4096").split(","))
# model.quantization=fp8: (N, K) count per step; configs (BLOCK_M, BLOCK_N, warps, stages), 64+ rows (wgmma)
FP8_SHAPES = {(8192, 2816): 25, (9216, 2816): 5, (2816, 4096): 25, (2816, 8192): 5, (2112, 2816): 62,
              (2816, 2112): 31}
FP8_CONFIGS = {"default": (64, 128, 4, 4), "64x64": (64, 64, 4, 4), "128x64": (128, 64, 4, 4),
               "128x128": (128, 128, 8, 3), "128x128w4": (128, 128, 4, 3), "64x256": (64, 256, 8, 3),
               "128x256": (128, 256, 8, 3), "64x64s3": (64, 64, 4, 3), "64x32": (64, 32, 4, 4),
               "64x32s6": (64, 32, 4, 6), "32x64 (mma.sync)": (32, 64, 4, 4),
               # TMA, and TMA with warp specialization (the 7th field), per-tile grid (6th: not persistent)
               "64x64s6 tma": (64, 64, 4, 6, True), "64x64s6 ws": (64, 64, 4, 6, True, False, True),
               "64x128 tma": (64, 128, 4, 4, True), "64x128 ws": (64, 128, 4, 4, True, False, True),
               "64x128s3 ws": (64, 128, 4, 3, True, False, True)}
# SHAPESET=llada: LLaDA2.0-mini's FP8 GEMMs a forward (the fused q/k/v and the attention output of 20 layers,
# layer 0's dense MLP; the shared experts ride the fused MoE), ROWS default 32 (batch 1) and 2048 (batch 64)
if os.environ.get("SHAPESET") == "llada":
    FP8_SHAPES = {(3072, 2048): 20, (2048, 2048): 20, (5120, 2048): 2, (2048, 5120): 1}
    ROWS = tuple(int(r) for r in os.environ.get("ROWS", "32,2048").split(","))


def run(x, w, cfg):
    if cfg is None:
        return x @ w.t()
    bm, bn, bk, warps, stages, tma, ws = (*cfg, False, False)[:7]
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), 1)
    x_desc = w_desc = None
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_desc, w_desc = TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk])
    im._matmul_kernel[grid](x, w, x_desc, w_desc, out, M, N, K, -(-K // bk) * bk, x.stride(0), x.stride(1),
                            w.stride(0), w.stride(1), 0, out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                            GROUP_M=im.GROUP_M, IEEE=False, TMA=tma, W_KN=False, WS=ws, num_warps=warps,
                            num_stages=stages)
    return out


def run_fp8(x, w, cfg):
    return fp8_matmul(x, *w, tiles=cfg)


def main():
    fp8 = "--fp8" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--fp8"]
    shapes, configs, run_cfg = (FP8_SHAPES, FP8_CONFIGS, run_fp8) if fp8 else (SHAPES, CONFIGS, run)
    torch.manual_seed(0)
    results = {}
    totals = {(name, m): 0.0 for name in configs for m in ROWS}
    for (n, k), count in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        w = quantize_blocks(w) if fp8 else w
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = run_cfg(x, w, configs["default"])
            for name, cfg in configs.items():
                try:
                    out = run_cfg(x, w, cfg)
                    same = torch.equal(out, ref)
                    ms = do_bench(lambda: run_cfg(x, w, cfg), warmup=10, rep=40, return_mode="median")
                except Exception as err:  # noqa: BLE001 - e.g. out of shared memory
                    same, ms = None, float("inf")
                    print(f"{name} at {n}x{k}: {type(err).__name__}: {str(err)[:100]}")
                results[f"{n}x{k}@{m}/{name}"] = {"ms": ms, "same_bits": same}
                totals[(name, m)] += count * ms
            # a line a shape as it finishes: a sweep the call's timeout cuts still leaves what it timed
            print(f"{n}x{k}@{m}: " + ", ".join(f"{c} {results[f'{n}x{k}@{m}/{c}']['ms'] * 1e3:.1f}"
                                               for c in configs), flush=True)
    print(f"\n{'shape':>14} {'rows':>5} " + " ".join(f"{c:>12}" for c in configs))
    for (n, k) in shapes:
        for m in ROWS:
            cells = []
            for name in configs:
                r = results[f"{n}x{k}@{m}/{name}"]
                cells.append(f"{r['ms'] * 1e3:>10.0f}{'' if r['same_bits'] else '!'}{' ' if r['same_bits'] else ''}")
            print(f"{n:>7}x{k:<6} {m:>5} " + " ".join(f"{c:>12}" for c in cells))
    print("(us; '!' = bits differ from the default config)")
    print(f"\nstep total ms ({' / '.join(map(str, ROWS))} rows):")
    for name in configs:
        print(f"  {name:>12}: " + " / ".join(f"{totals[(name, m)]:.2f}" for m in ROWS))
    best = {}
    for (n, k), count in shapes.items():
        ours = (c for c in configs if configs[c] is not None)
        best[f"{n}x{k}"] = min(ours, key=lambda c: sum(count * results[f"{n}x{k}@{m}/{c}"]["ms"] for m in ROWS))
    print("best config per shape (256 + 4096 rows):", best)
    if args:
        json.dump({"results": results, "best": best}, open(args[0], "w"), indent=1)


if __name__ == "__main__":
    main()
