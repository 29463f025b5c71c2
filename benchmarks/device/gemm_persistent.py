"""Persistent TMA GEMMs against per-tile TMA GEMMs, under CUDA graphs (GPU).

The per-tile TMA kernels (kernels/invariant_matmul.py, kernels/fp8_gemm.py) launch a program per output tile; their
persistent launches (kernels/tma.py: from tma.PERSISTENT_ROWS rows, FLUXLAB_PERSISTENT) launch tma.PROGRAMS_PER_SM
programs an SM that walk the same tiles in turn. Neither changes what a tile sums or in which order, so the
persistent launch must give the per-tile kernel's bits (the bits column). Both are timed here at every row count,
whatever the shipped rule picks, at the per-step GEMMs of Diffusion-Gemma 26B-A4B (bf16 and model.quantization=fp8)
at 256 / 4096 rows and LLaDA2.0-mini's FP8 ones at 32 / 2048 rows, as in gemm_tma.py, whose timing this uses (graph
replays over weight copies past L2). The self-conditioning product (K-slices: never persistent) is left out.
Prints each model's GEMMs a step both ways, then per shape the faster.
Usage: python3 benchmarks/device/gemm_persistent.py [out.json]   (KINDS=fp8,bf16)
"""
import json
import os
import sys

import torch

from fluxlab.bench.moe_tune import graph_ms

sys.path.insert(0, os.path.dirname(__file__))
from gemm_tma import DEVICE, MODELS, call, shipped, weight  # noqa: E402


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    kinds = os.environ.get("KINDS", "fp8,bf16").split(",")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    results, best = {}, {}
    for (kind, model), spec in MODELS.items():
        if kind not in kinds:
            continue
        for rows in spec["rows"]:
            names = ["tma", "persistent"]
            totals, same = dict.fromkeys(names, 0.0), dict.fromkeys(names, True)
            for (n, k, *layout), count in spec["gemms"].items():
                if layout:  # the self-conditioning product: K-slices, not this kernel's shape
                    continue
                copies = [weight(kind, n, k, False, gen) for _ in range(max(1, round(160e6 / (n * k))))]
                x = torch.randn(rows, k, generator=gen, device=DEVICE).to(torch.bfloat16)
                eager = call(kind, x, copies[0])
                tiles = shipped(kind, rows, n, k)
                shape = f"{kind} {model} {n}x{k} @{rows}"
                for name in names:
                    if totals[name] is None:
                        continue
                    calls = [lambda w=w, p=name == "persistent": call(kind, x, w, (*tiles, 1, p)) for w in copies]
                    try:
                        ms = graph_ms(lambda calls=calls: [c() for c in calls]) / len(calls)
                        bits = torch.equal(calls[0](), eager)
                    except Exception as err:  # does not compile / run here: not a candidate
                        print(f"{shape} {name}: {repr(err)[:300]}", flush=True)
                        totals[name] = None
                        continue
                    same[name] = same[name] and bits
                    totals[name] += ms * count
                    results[f"{shape} {name}"] = {"ms": ms, "same_bits": bits}
                    if bits and (shape not in best or ms < best[shape][1]):
                        best[shape] = (name, ms)
                del copies
            for name in names:
                if totals[name] is not None:
                    key = f"{kind} {model} gemms a step @{rows} {name}"
                    results[key] = {"ms": totals[name], "same_bits": same[name]}
                    print(f"{key:>62} {totals[name]:>8.3f} {same[name]}", flush=True)
            if args:
                json.dump(results, open(args[0], "w"), indent=1)
    print("gemms a step: sum of graph-replay ms x count (no self-conditioning product); bits: = the shipped eager")
    print(f"\n{'fastest with the shipped bits, a call':>46} {'ms':>8} (shipped tma)")
    for shape, (name, ms) in best.items():
        print(f"{shape:>46} {ms:>8.4f} {name} ({results[shape + ' tma']['ms']:.4f})")


if __name__ == "__main__":
    main()
