"""The FP8 kernels of one source tree, for an A/B of two trees in one call (GPU): outputs saved, graph-replay times.

Run once per tree (PYTHONPATH picks it), then `--compare a.pt b.pt` prints each case's times side by side and whether
the outputs are equal bit for bit. Cases: the FP8 GEMM (kernels/fp8_gemm.py) at Diffusion-Gemma 26B-A4B's shapes
(model.quantization=fp8) at 256 / 4096 rows and LLaDA2.0-mini's at 32 / 2048, each eager (pointer loads) and as the
graphs launch it (TMA tiles, persistent from the row count `tma.persistent` names; env PATHS=graph: that one only); the
FP8 fused MoE (kernels/fp8_moe.py) at DG's experts (E 128, H 2816, I 704, top-8, gelu-tanh) at 256 / 4096 tokens and
LLaDA2.0-mini's (E 256, H 2048, I 512, top-8, SiLU) at 32 / 2048. Inputs come from seeded generators on the device, so
both trees see the same numbers. Times: replays of one CUDA graph (`fluxlab.bench.moe_tune.graph_ms`), GEMM weights
rotated through copies past L2.
Usage: python3 benchmarks/device/fp8_ab.py OUT.pt | python3 benchmarks/device/fp8_ab.py --compare A.pt B.pt
"""
import os
import sys

import torch

DEVICE = "cuda"
GEMMS = {"dg": ({(8192, 2816): 25, (9216, 2816): 5, (2816, 4096): 25, (2816, 8192): 5, (2112, 2816): 60,
                 (2816, 2112): 30}, (256, 4096)),
         "llada": ({(3072, 2048): 20, (2048, 2048): 20, (5120, 2048): 2, (2048, 5120): 1}, (32, 2048))}
MOES = {"dg": ((128, 2816, 704, 8, "gelu_tanh"), 30, (256, 4096)),
        "llada": ((256, 2048, 512, 8, "silu"), 19, (32, 2048))}
COPIES_BYTES = 160e6
PATHS = os.environ.get("PATHS", "eager,graph").split(",")  # the GEMM's launch paths timed


def run(out_path: str) -> None:
    from fluxlab.bench.moe_tune import graph_ms
    from fluxlab.engine.layers.fp8 import quantize_blocks, quantize_stacked
    from fluxlab.kernels import fp8_gemm, tma
    from fluxlab.kernels.fp8_gemm import fp8_matmul
    from fluxlab.kernels.fp8_moe import fp8_fused_moe

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    saved = {}

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE)

    for model, (shapes, row_counts) in GEMMS.items():
        for (n, k), count in shapes.items():
            copies = [quantize_blocks((randn(n, k) * 0.02).to(torch.bfloat16))
                      for _ in range(max(1, round(COPIES_BYTES / (n * k))))]
            for rows in row_counts:
                x = randn(rows, k).to(torch.bfloat16)
                tiles = fp8_gemm.tile_for(rows, n, k)
                paths = {"eager": tiles, "graph": (*tiles, 1, tma.persistent("fp8_gemm", rows))}
                for path, full in ((p, paths[p]) for p in PATHS):
                    calls = [lambda w=w, full=full: fp8_matmul(x, *w, tiles=full) for w in copies]
                    ms = graph_ms(lambda calls=calls: [c() for c in calls]) / len(calls)
                    saved[f"gemm {model} {n}x{k} @{rows} {path}"] = (ms, count, calls[0]().cpu())
                    print(f"gemm {model} {n}x{k} @{rows} {path}: {ms * 1e3:.1f} us", flush=True)
            del copies
    for model, ((e, h, i, top_k, act), count, token_counts) in MOES.items():
        w_gate_up, s_gate_up = quantize_stacked((randn(e, 2 * i, h) * 0.02).to(torch.bfloat16), 2)
        w_down, s_down = quantize_blocks((randn(e, h, i) * 0.02).to(torch.bfloat16))
        for tokens in token_counts:
            x = randn(tokens, h).to(torch.bfloat16)
            logits = randn(tokens, e)
            weight, index = torch.softmax(logits, -1).topk(top_k, dim=-1)

            def moe():
                return fp8_fused_moe(x, index, weight, w_gate_up, s_gate_up, w_down, s_down, activation=act)
            ms = graph_ms(moe)
            saved[f"moe {model} @{tokens}"] = (ms, count, moe().cpu())
            print(f"moe {model} @{tokens}: {ms * 1e3:.1f} us", flush=True)
    torch.save(saved, out_path)


def compare(a_path: str, b_path: str) -> None:
    a, b = torch.load(a_path), torch.load(b_path)
    print(f"{'case':>40} {'A us':>9} {'B us':>9} {'B/A':>6} same   (step ms: count x call)")
    steps = {}
    for key in a:
        (ms_a, count, out_a), (ms_b, _, out_b) = a[key], b[key]
        print(f"{key:>40} {ms_a * 1e3:>9.1f} {ms_b * 1e3:>9.1f} {ms_b / ms_a:>6.3f} {torch.equal(out_a, out_b)}")
        parts = key.split()  # a GEMM's shape left out: a model's GEMMs at a row count and path; a MoE call as it is
        group = " ".join(parts[:2] + parts[3:]) if parts[0] == "gemm" else key
        steps.setdefault(group, [0.0, 0.0])
        steps[group][0] += ms_a * count
        steps[group][1] += ms_b * count
    for group, (ms_a, ms_b) in steps.items():
        print(f"{group + ' a step':>40} {ms_a:>8.3f}m {ms_b:>8.3f}m {ms_b / ms_a:>6.3f}")


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        run(sys.argv[1])
