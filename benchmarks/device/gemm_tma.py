"""The GEMM kernels with TMA tiles against pointer loads, under CUDA graphs (GPU).

Inside `tma.graph_tiles()` (the graph runners' warm-up and capture, fluxlab/kernels/tma.py) the FP8 GEMM
(kernels/fp8_gemm.py) and the batch-invariant bf16 matmul (kernels/invariant_matmul.py) load their x and w tiles
through TMA descriptors; here explicit `tiles=(..., 1)` / `(..., 0)` pick TMA / pointer loads. Both sum the same
products in the same order, so every variant must equal the default eager (pointer) output bit for bit: the bits
column. Each is timed as replays of one CUDA graph over copies of the weight that overflow L2
(`fluxlab.bench.moe_tune.graph_ms`: no host time), at the models' shapes: the FP8 GEMMs of Diffusion-Gemma 26B-A4B
(model.quantization=fp8) at 256 / 4096 rows (1 / 16 canvases) and of LLaDA2.0-mini at 32 / 2048 (decode batch 1 /
64); Diffusion-Gemma's bf16 matmuls (the layers, the head, the self-conditioning product over the embedding seen as
[K, N]) at 256 / 4096 rows. Prints the per-step sum of each model's GEMMs. "tma" is the per-tile launch at every row
count, "persistent" the persistent one (kernels/tma.py, shipped from 1024 rows; `tiles=(..., 1, True)`), also at
every row count; the self-conditioning product's K-slices never launch persistently, so there both are per tile.
With --sweep it also times each TMA tile config (BLOCK_M, BLOCK_N, warps, stages) at each row count and prints each
shape's fastest config with the bits: the row-count tile choice re-checked under graph replay (the earlier sweeps,
diffusion_gemma_matmul_tiles.py, timed eagerly, which is host-bound at small rows). A config whose bits differ from
the default's is printed, never a candidate. KINDS=fp8,bf16 (default both) picks the kernels.
Usage: python3 benchmarks/device/gemm_tma.py [out.json] [--sweep]
"""
import json
import os
import sys

import torch

import fluxlab.kernels.invariant_matmul as im
from fluxlab.bench.moe_tune import graph_ms
from fluxlab.engine.layers.fp8 import quantize_blocks
from fluxlab.kernels import fp8_gemm
from fluxlab.kernels.fp8_gemm import fp8_matmul

DEVICE = "cuda"
# (N, K): GEMMs a step (the engine's fused layouts; docs in diffusion_gemma_matmul_tiles.py); "T": w is a [K, N]
# tensor seen through .t() (the self-conditioning product over the embedding)
MODELS = {
    ("fp8", "diffusion_gemma"): {"gemms": {(8192, 2816): 25, (9216, 2816): 5, (2816, 4096): 25, (2816, 8192): 5,
                                           (2112, 2816): 60, (2816, 2112): 30}, "rows": (256, 4096)},
    ("fp8", "llada2_mini"): {"gemms": {(3072, 2048): 20, (2048, 2048): 20, (5120, 2048): 2, (2048, 5120): 1},
                             "rows": (32, 2048)},
    ("bf16", "diffusion_gemma"): {"gemms": {(8192, 2816): 25, (9216, 2816): 5, (2816, 4096): 25, (2816, 8192): 5,
                                            (4224, 2816): 30, (2112, 2816): 2, (2816, 2112): 31, (128, 2816): 30,
                                            (262144, 2816): 1, (2816, 262144, "T"): 1}, "rows": (256, 4096)},
}
# TMA tile configs (BLOCK_M, BLOCK_N, warps, stages) for --sweep; BLOCK_M >= 64 keeps the wgmma path
SWEEP = {"fp8": [(64, 32, 4, 4), (64, 64, 4, 3), (64, 64, 4, 6), (64, 128, 4, 3), (64, 128, 8, 4), (128, 64, 8, 4),
                 (128, 128, 8, 3), (64, 256, 8, 3)],
         "bf16": [(64, 32, 4, 4), (64, 64, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 8, 4), (128, 256, 8, 3),
                  (64, 256, 8, 3)]}
COPIES_BYTES = 160e6  # weight copies a GEMM rotates through: past the 50 MB L2 of an H100 / H200


def shipped(kind: str, rows: int, n: int, k: int) -> tuple:
    if kind == "fp8":
        return fp8_gemm.tile_for(rows, n, k)
    return im.tile_for(rows, n, k)


def weight(kind: str, n: int, k: int, transposed: bool, gen):
    if kind == "fp8":
        return quantize_blocks((torch.randn(n, k, generator=gen, device=DEVICE) * 0.02).to(torch.bfloat16))
    if transposed:
        return (torch.randn(k, n, generator=gen, device=DEVICE) * 0.02).to(torch.bfloat16).t(),
    return (torch.randn(n, k, generator=gen, device=DEVICE) * 0.02).to(torch.bfloat16),


def call(kind: str, x, w: tuple, tiles=None):
    return fp8_matmul(x, *w, tiles=tiles) if kind == "fp8" else im.matmul(x, *w, tiles=tiles)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    kinds = os.environ.get("KINDS", "fp8,bf16").split(",")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    results, best = {}, {}
    for (kind, model), spec in MODELS.items():
        if kind not in kinds:
            continue
        variants = {"pointers": (None, 0, False), "tma": (None, 1, False), "persistent": (None, 1, True)}
        if "--sweep" in sys.argv:
            variants.update({"tma %dx%d w%d s%d" % cfg: (cfg, 1, False) for cfg in SWEEP[kind]})
        for rows in spec["rows"]:
            totals, same = dict.fromkeys(variants, 0.0), dict.fromkeys(variants, True)
            for (n, k, *layout), count in spec["gemms"].items():
                copies = [weight(kind, n, k, bool(layout), gen)
                          for _ in range(max(1, round(COPIES_BYTES / (n * k))))]
                x = torch.randn(rows, k, generator=gen, device=DEVICE).to(torch.bfloat16)
                eager = call(kind, x, copies[0])  # the default outside graph_tiles(): pointer loads
                shape = f"{kind} {model} {n}x{k}{'T' if layout else ''} @{rows}"
                for name, (cfg, tma, persistent) in variants.items():
                    if totals[name] is None:
                        continue
                    tiles = (*(cfg or shipped(kind, rows, n, k)), tma, persistent)
                    calls = [lambda w=w, tiles=tiles: call(kind, x, w, tiles) for w in copies]
                    try:
                        ms = graph_ms(lambda calls=calls: [c() for c in calls]) / len(calls)
                    except Exception as err:  # out of shared memory / registers: not a candidate
                        print(f"{shape} {name}: {repr(err)[:160]}")
                        totals[name] = None
                        continue
                    bits = torch.equal(calls[0](), eager)
                    same[name] = same[name] and bits
                    totals[name] += ms * count
                    results[f"{shape} {name}"] = {"ms": ms, "same_bits": bits}
                    if bits and (shape not in best or ms < best[shape][1]):
                        best[shape] = (name, ms)
                del copies
            for name in variants:  # printed as they come: a timeout keeps what was measured
                if totals[name] is not None:
                    key = f"{kind} {model} gemms a step @{rows} {name}"
                    results[key] = {"ms": totals[name], "same_bits": same[name]}
                    print(f"{key:>58} {totals[name]:>8.3f} {same[name]}", flush=True)
            if args:
                json.dump(results, open(args[0], "w"), indent=1)
    print("gemms a step: sum of graph-replay ms x count; bits: every call equals the default eager one")
    print(f"\n{'fastest with the default bits, a call':>46} {'ms':>8} (tma, shipped tiles)")
    for shape, (name, ms) in best.items():
        print(f"{shape:>46} {ms:>8.4f} {name} ({results[shape + ' tma']['ms']:.4f})")


if __name__ == "__main__":
    main()
