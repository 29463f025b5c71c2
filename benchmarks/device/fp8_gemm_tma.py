"""The FP8 GEMM (kernels/fp8_gemm.py) with TMA tiles against pointer loads, under CUDA graphs (GPU).

Inside `fp8_gemm.graph_tiles()` (the graph runners' warm-up and capture) `fp8_matmul` loads its x and w tiles
through TMA descriptors; here `tiles=(..., 1)` / `(..., 0)` pick TMA / pointer loads explicitly. Both sum the same
products in the same order, so the TMA output must equal the default eager (pointer) one bit for bit (explicit
tiles take TMA eagerly too): the bits column. Each is timed as replays of one CUDA graph over
copies of the weight that overflow L2 (`fluxlab.bench.moe_tune.graph_ms`: no host time), at both
models' shapes: Diffusion-Gemma 26B-A4B at 256 / 4096 rows (1 / 16 canvases), LLaDA2.0-mini at 32 / 2048 (decode
batch 1 / 64); prints the per-step sum of each model's GEMMs. (The 2026-12-06 sweep that also tried paired K-blocks
and TMA in the fused MoE, since dropped, is in docs/benchmarks.md.)
Usage: python3 benchmarks/device/fp8_gemm_tma.py [out.json]
"""
import json
import sys

import torch

from fluxlab.bench.moe_tune import graph_ms
from fluxlab.engine.layers.fp8 import quantize_blocks
from fluxlab.kernels import fp8_gemm
from fluxlab.kernels.fp8_gemm import fp8_matmul

DEVICE = "cuda"
# (N, K): GEMMs a step (the engine's fused layouts; docs in diffusion_gemma_matmul_tiles.py)
MODELS = {
    "diffusion_gemma": {"gemms": {(8192, 2816): 25, (9216, 2816): 5, (2816, 4096): 25, (2816, 8192): 5,
                                  (2112, 2816): 60, (2816, 2112): 30}, "rows": (256, 4096)},
    "llada2_mini": {"gemms": {(3072, 2048): 20, (2048, 2048): 20, (5120, 2048): 2, (2048, 5120): 1},
                    "rows": (32, 2048)},
}
VARIANTS = {"pointers": 0, "tma": 1}
COPIES_BYTES = 160e6  # weight copies a GEMM rotates through: past the 50 MB L2 of an H100 / H200


def main():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    results = {}
    for model, spec in MODELS.items():
        for rows in spec["rows"]:
            x = torch.randn(rows, 8192, generator=gen, device=DEVICE).to(torch.bfloat16)
            bn = fp8_gemm.WIDE_N if rows >= fp8_gemm.WIDE_ROWS else fp8_gemm.BLOCK_N
            totals, same = dict.fromkeys(VARIANTS, 0.0), dict.fromkeys(VARIANTS, True)
            for (n, k), count in spec["gemms"].items():
                copies = [quantize_blocks((torch.randn(n, k, generator=gen, device=DEVICE) * 0.02).to(torch.bfloat16))
                          for _ in range(max(1, round(COPIES_BYTES / (n * k))))]
                xk = x[:, :k].contiguous()
                eager = fp8_matmul(xk, *copies[0])  # pointer loads: no capture
                for name, tma in VARIANTS.items():
                    tiles = (fp8_gemm.BLOCK_M, bn, fp8_gemm.WARPS, fp8_gemm.STAGES, tma)
                    calls = [lambda w=w, tiles=tiles: fp8_matmul(xk, *w, tiles=tiles) for w in copies]
                    ms = graph_ms(lambda calls=calls: [call() for call in calls]) / len(calls)
                    same[name] = same[name] and torch.equal(calls[0](), eager)
                    totals[name] += ms * count
                    results[f"{model} gemm {n}x{k} @{rows} {name}"] = ms
            for name in VARIANTS:
                results[f"{model} gemms a step @{rows} {name}"] = {"ms": totals[name], "same_bits": same[name]}
    print(f"\n{'what':>44} {'ms':>8} bits")
    for key, val in results.items():
        if isinstance(val, dict):
            print(f"{key:>44} {val['ms']:>8.3f} {val['same_bits']}")
    print("bits: the variant's output equals the default eager one; gemms a step: sum of graph-replay ms x count")
    if sys.argv[1:]:
        json.dump(results, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
