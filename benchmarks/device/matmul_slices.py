"""K-slices by weight shape for the batch-invariant bf16 matmul (kernels/invariant_matmul.py SHAPE_SLICES), GPU.

At one canvas (256 rows) a narrow weight's product has few output tiles, each walking a long K loop; cutting K into
S slices fixed by the weight's shape gives S times the programs there (their fp32 partials summed in slice order), and
from WALK_ROWS rows one program walks its tile's S slices (no partials): the same sums, so a row's bits alone equal
its bits among 16 canvases -- the `same` column (256 rows alone against the first 256 of 4096). For each of
Diffusion-Gemma 26B-A4B's bf16 layer products and each S, times the product as CUDA-graph replays over weight copies
past L2 (TMA tiles, as the graph runners take them): at 256 rows on the small tile of the table and a few others, at
4096 rows on the table's tile, launched persistently (as shipped from 1024 rows). S = 1 is today's product. Prints
each shape's best S at 256 rows with its 4096-row cost, and the step's sum (count x ms) for the chosen S.
Usage: python3 benchmarks/device/matmul_slices.py [out.json] (the sweep; out.json gets the table `pick` chooses)
       python3 benchmarks/device/matmul_slices.py --bench table.json ARGS (fluxlab.bench.canvas ARGS with that table)
"""
import json
import sys

import torch

import fluxlab.kernels.invariant_matmul as im
from fluxlab.bench.moe_tune import graph_ms

DEVICE = "cuda"
COPIES_BYTES = 160e6  # past the 50 MB L2
# (N, K): (calls a step, candidate slices); the dense MLP's gate/up and down run beside the experts on a second stream
SHAPES = {(2816, 4096): (25, (1, 2, 4, 8)), (2816, 8192): (5, (1, 2, 4, 8)), (128, 2816): (30, (1, 2, 4)),
          (8192, 2816): (25, (1, 2)), (9216, 2816): (5, (1, 2)), (4224, 2816): (30, (1, 2)),
          (2816, 2112): (30, (1, 3))}
MAX_LARGE_COST = 0.05  # ms a step at 16 canvases a slicing may cost
SMALL_CANDIDATES = [(64, 64, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 8, 3), (64, 32, 4, 4)]


def timed(x, copies, tiles) -> tuple[float, torch.Tensor]:
    calls = [lambda w=w: im.matmul(x, w, tiles=tiles) for w in copies]
    return graph_ms(lambda: [c() for c in calls]) / len(calls), calls[0]()


def pick(summary: list) -> dict:
    """Per shape, the S (and its 256-row tile) that gains most at 256 rows while costing at most MAX_LARGE_COST ms
    a step at 4096: {"NxK": [S, tile]}."""
    table = {}
    for n, k, count, s, (ms, cfg), large_ms, base in summary:
        gain, cost = count * (base[0] - ms), count * (large_ms - base[1])
        key = f"{n}x{k}"
        if s > 1 and gain > 0 and cost <= MAX_LARGE_COST and gain > table.get(key, (0, None, 0.0))[2]:
            table[key] = (s, list(cfg), gain)
    return {key: [s, cfg] for key, (s, cfg, _) in table.items()}


def bench(table_path: str, argv: list) -> None:
    """fluxlab.bench.canvas with SHAPE_SLICES and the small tiles of `table_path` (this process only)."""
    from fluxlab.bench.canvas import main as canvas_main

    for key, (s, cfg) in json.load(open(table_path)).items():
        n, k = (int(v) for v in key.split("x"))
        im.SHAPE_SLICES[(n, k)], im.SMALL_TILES[(n, k)] = s, tuple(cfg)
    print("SHAPE_SLICES", im.SHAPE_SLICES, flush=True)
    canvas_main(argv)


def main():
    if sys.argv[1:2] == ["--bench"]:
        return bench(sys.argv[2], sys.argv[3:])
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    results, summary = {}, []
    for (n, k), (count, slices) in SHAPES.items():
        copies = [(torch.randn(n, k, generator=gen, device=DEVICE) * 0.02).bfloat16()
                  for _ in range(max(1, round(COPIES_BYTES / (2 * n * k))))]
        x = torch.randn(4096, k, generator=gen, device=DEVICE).bfloat16()
        base = None
        for s in slices:
            im.SHAPE_SLICES[(n, k)] = s
            large_ms, large_out = timed(x, copies, (*im.tile_for(4096, n, k), 1, True))
            best = None
            for cfg in dict.fromkeys([im.tile_for(256, n, k), *SMALL_CANDIDATES]):
                try:
                    ms, out = timed(x[:256].contiguous(), copies, (*cfg, 1, False))
                except Exception as err:  # out of resources: not a candidate
                    print(f"{n}x{k} S={s} {cfg}: {repr(err)[:120]}")
                    continue
                same = torch.equal(out, large_out[:256])
                results[f"{n}x{k} S={s} @256 {cfg}"] = {"ms": ms, "same": same}
                print(f"{n}x{k} S={s} @256 {cfg}: {ms:.4f} ms same={same}", flush=True)
                if same and (best is None or ms < best[0]):
                    best = (ms, cfg)
            results[f"{n}x{k} S={s} @4096"] = {"ms": large_ms}
            print(f"{n}x{k} S={s} @4096 persistent {im.tile_for(4096, n, k)}: {large_ms:.4f} ms", flush=True)
            if best is None:
                continue
            if s == 1:
                base = (best[0], large_ms)
            summary.append((n, k, count, s, best, large_ms, base))
            if out_path:
                json.dump({"table": pick(summary), "results": results}, open(out_path, "w"), indent=1)
        del im.SHAPE_SLICES[(n, k)]
        del copies
    print(f"\n{'shape':>12} {'calls':>5} {'S':>2} {'ms@256':>8} {'tile@256':>18} {'ms@4096':>8} "
          f"{'step d@256':>10} {'step d@4096':>11}")
    for n, k, count, s, (ms, cfg), large_ms, base in summary:
        d_small = count * (ms - base[0]) if base else float("nan")
        d_large = count * (large_ms - base[1]) if base else float("nan")
        print(f"{n}x{k:<6} {count:>5} {s:>2} {ms:>8.4f} {str(cfg):>18} {large_ms:>8.4f} {d_small:>10.3f} "
              f"{d_large:>11.3f}")
    print("step d = calls x (ms - the S=1 ms at the same rows); same bits checked for every 256-row row printed")
    print("table:", json.dumps(pick(summary)))


if __name__ == "__main__":
    main()
