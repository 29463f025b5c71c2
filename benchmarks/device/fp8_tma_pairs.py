"""FP8 kernels with TMA weight tiles and paired K-blocks, against the shipped configs (GPU).

Two switches the FP8 GEMM (kernels/fp8_gemm.py) and the FP8 fused MoE (kernels/fp8_moe.py) take: TMA (weight
tiles, and the GEMM's activation tiles, through tensor descriptors) and PAIRS (two K-blocks an iteration, both
e4m3 dots taken before either is scaled and added, so the adds keep their order). Neither changes what is
summed or in which order, so each variant must give the shipped kernel's bits; this checks that (bits column)
and times each under a CUDA graph (weights past L2) at both models' shapes: Diffusion-Gemma 26B-A4B at
256 / 4096 rows (batch 1 / 16 canvases), LLaDA2.0-mini at 32 / 2048 (decode batch 1 / 64). Prints the per-step
sum of each model's GEMMs and the MoE per layer.
Usage: python3 benchmarks/device/fp8_tma_pairs.py [out.json]
"""
import dataclasses
import json
import sys

import torch

from fluxlab.engine.layers.fp8 import quantize_blocks, quantize_stacked
from fluxlab.kernels import fp8_gemm
from fluxlab.kernels.fp8_gemm import fp8_matmul
from fluxlab.kernels.fp8_moe import FP8MoEConfig, fp8_fused_moe

DEVICE = "cuda"
# (N, K): GEMMs a step (the engine's fused layouts; docs in diffusion_gemma_matmul_tiles.py)
MODELS = {
    "diffusion_gemma": {"gemms": {(8192, 2816): 25, (9216, 2816): 5, (2816, 4096): 25, (2816, 8192): 5,
                                  (2112, 2816): 60, (2816, 2112): 30},
                        "rows": (256, 4096), "moe": (128, 8, 2816, 704, "gelu_tanh")},
    "llada2_mini": {"gemms": {(3072, 2048): 20, (2048, 2048): 20, (5120, 2048): 2, (2048, 5120): 1},
                    "rows": (32, 2048), "moe": (257, 9, 2048, 512, "silu")},  # 256 routed + the shared one
}
GEMM_VARIANTS = {"shipped": None, "pairs": (0, 1), "tma": (1, 0)}
R = dataclasses.replace
MOE_VARIANTS = {"shipped": FP8MoEConfig(), "tma1": R(FP8MoEConfig(), TMA1=1), "tma2": R(FP8MoEConfig(), TMA2=1),
                "tma1+tma2": R(FP8MoEConfig(), TMA1=1, TMA2=1), "pairs2": R(FP8MoEConfig(), PAIRS2=1),
                "shipped again": FP8MoEConfig()}
COPIES_BYTES = 160e6  # weight copies a GEMM rotates through: past the 50 MB L2 of an H100 / H200


def gemm_tiles(rows, variant):
    if variant is None:
        return None
    bn = fp8_gemm.WIDE_N if rows >= fp8_gemm.WIDE_ROWS else fp8_gemm.BLOCK_N
    return (fp8_gemm.BLOCK_M, bn, fp8_gemm.WARPS, fp8_gemm.STAGES, *variant)


def bench(calls, reps=10):
    """ms a call of `calls` (zero-argument callables) replayed in sequence under one CUDA graph: no host
    time (TMA descriptors are encoded at capture); copies of the weights rotate so they stream from HBM."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (reps * len(calls)))
    return sorted(times)[2]


def main():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    results = {}
    for model, spec in MODELS.items():
        for rows in spec["rows"]:
            x = torch.randn(rows, 8192, generator=gen, device=DEVICE).to(torch.bfloat16)
            totals = {v: 0.0 for v in GEMM_VARIANTS}
            same = {v: True for v in GEMM_VARIANTS}
            for (n, k), count in spec["gemms"].items():
                copies = [quantize_blocks((torch.randn(n, k, generator=gen, device=DEVICE) * 0.02).to(torch.bfloat16))
                          for _ in range(max(1, round(COPIES_BYTES / (n * k))))]
                xk = x[:, :k].contiguous()
                ref = fp8_matmul(xk, *copies[0])
                for name, variant in GEMM_VARIANTS.items():
                    def run(variant=variant, xk=xk, w=copies[0]):
                        return fp8_matmul(xk, *w, tiles=gemm_tiles(rows, variant))
                    calls = [lambda w=w, variant=variant, xk=xk: fp8_matmul(xk, *w, tiles=gemm_tiles(rows, variant))
                             for w in copies]
                    try:
                        same[name] = same[name] and torch.equal(run(), ref)
                        ms = bench(calls)
                    except Exception as err:  # noqa: BLE001 - e.g. a descriptor the shape refuses
                        ms, same[name] = float("inf"), None
                        print(f"{model} gemm {n}x{k} {name} @{rows}: {type(err).__name__}: {str(err)[:160]}")
                    totals[name] += ms * count
                    results[f"{model} gemm {n}x{k} @{rows} {name}"] = ms
            for name in GEMM_VARIANTS:
                results[f"{model} gemms a step @{rows} {name}"] = {"ms": totals[name], "same_bits": same[name]}
        e, top_k, h, inter, act = spec["moe"]
        w_gate_up = (torch.randn(e, 2 * inter, h, generator=gen, device=DEVICE) * 0.02).to(torch.bfloat16)
        w_down = (torch.randn(e, h, inter, generator=gen, device=DEVICE) * 0.02).to(torch.bfloat16)
        weights = (*quantize_stacked(w_gate_up, 2), *quantize_blocks(w_down))
        del w_gate_up, w_down
        shared = model == "llada2_mini"  # the shared expert is every token's last slot (fp8_fused_moe shared_last)
        for tokens in spec["rows"]:
            x = (torch.randn(tokens, h, generator=gen, device=DEVICE) * 0.5).to(torch.bfloat16)
            scores = torch.rand(tokens, e - shared, generator=gen, device=DEVICE)
            topw, index = scores.topk(top_k - shared, dim=-1)
            topw = topw / topw.sum(-1, keepdim=True)
            if shared:
                index = torch.cat([index, torch.full_like(index[:, :1], e - 1)], 1)
                topw = torch.cat([topw, torch.ones_like(topw[:, :1])], 1)
            ref = fp8_fused_moe(x, index, topw, *weights, activation=act, shared_last=shared)
            for name, cfg in MOE_VARIANTS.items():
                def run(cfg=cfg, x=x, index=index, topw=topw):
                    return fp8_fused_moe(x, index, topw, *weights, config=cfg, activation=act,
                                         shared_last=shared)
                try:
                    results[f"{model} moe @{tokens} {name}"] = {"ms": bench([run]), "same_bits": torch.equal(run(), ref)}
                except Exception as err:  # noqa: BLE001 - e.g. out of shared memory
                    results[f"{model} moe @{tokens} {name}"] = {"ms": float("inf"), "same_bits": None}
                    print(f"{model} moe {name} @{tokens}: {type(err).__name__}: {str(err)[:160]}")
    print(f"\n{'what':>44} {'ms':>8} bits")
    for key, val in results.items():
        if isinstance(val, dict):
            print(f"{key:>44} {val['ms']:>8.3f} {val['same_bits']}")
    print("bits: equal to the shipped kernel's output on the same input; gemms a step: sum of graph-replay ms x count")
    if sys.argv[1:]:
        json.dump(results, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
