"""Tune the fused MoE kernel's tile configs by measurement (GPU): `python -m fluxlab.bench.moe_tune`.

    python -m fluxlab.bench.moe_tune [--shape mini] [--tokens 32,512,1024,2048,4096] [--out PATH]
        [--budget-s 120]

For each token count T, with random bf16 expert weights and the real router's choices (random gate
weights, n_group 8 / topk_group 4, top-8 of 256): for each BLOCK_M that suits T's rows per expert,
times the gate/up kernel over candidate (BLOCK_N, BLOCK_K, warps, stages), then the best tile with
each row-tile shrink (SHRINK1 1, 2: half/quarter-height GEMMs for an expert's last tile), then the
best of those with its weight tiles through TMA (TMA1, sm90+), and the
down kernel likewise on the best gate/up output (the two kernels share only BLOCK_M), each with
triton.testing.do_bench (median). The best BLOCK_M's pair is then timed as a whole layer under a CUDA
graph beside the heuristic config, checked against it (bf16 tolerance), and kept only where it is
faster. Writes the table `fused_moe` reads (kernels/moe_configs/<GPU>.json, merged with what is
there) and prints a small table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

SHAPES = {"mini": (2048, 512), "flash": (4096, 1024)}
NUM_EXPERTS, TOP_K, N_GROUP, TOPK_GROUP, SCALE = 256, 8, 8, 4, 2.5
# (BLOCK_N, BLOCK_K, warps, stages), for either kernel
TILES = [(64, 128, 4, 3), (64, 128, 4, 4), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (32, 128, 4, 4)]


def block_m_candidates(num_tokens: int) -> list[int]:
    """BLOCK_M near the mean rows per expert (T * K / E): smaller wastes weight reuse, larger pads
    (up to 4x the mean: a shrunk last tile pads less)."""
    rows = num_tokens * TOP_K / NUM_EXPERTS
    return [bm for bm in (16, 32, 64, 128) if rows / 4 <= bm <= max(16, 4 * rows)]


def shrink_candidates(block_m: int) -> list[int]:
    """SHRINK1/SHRINK2 values beside 0 for this BLOCK_M (row tiles of at least 16 rows)."""
    return [s for s in (1, 2) if block_m >> s >= 16]


def bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def graph_ms(fn, iters: int = 20) -> float:
    from fluxlab.bench.moe_layer import _time_graph

    return _time_graph(fn, iters)


def _time_candidates(stage: list, configs: list, run, tried: list, kernel: int):
    """Appends (ms, config) to stage for each config that runs (else its error to tried); -> the
    best so far, None if none ran."""
    for cfg in configs:
        try:
            stage.append((bench(lambda: run(cfg)), cfg))
        except Exception as err:  # out of shared memory / registers: not a candidate
            tried.append({"BLOCK_M": cfg.BLOCK_M, "kernel": kernel, "config": dataclasses.asdict(cfg),
                          "error": repr(err)[:200]})
    return _best(stage) if stage else None


def _best(stage: list):
    return min(stage, key=lambda t: t[0])[1]


def tune_tokens(num_tokens: int, weights, gate, deadline: float) -> dict:
    from fluxlab.engine.layers.moe import route
    from fluxlab.kernels.fused_moe import down_stage, fused_moe, gate_up_stage
    from fluxlab.kernels.moe_align import moe_align
    from fluxlab.kernels.moe_config import MoEConfig, heuristic_config

    w_gate_up, w_down = weights
    gate_w, bias = gate
    hidden = w_gate_up.shape[2]
    x = torch.randn(num_tokens, hidden, device=w_gate_up.device, dtype=w_gate_up.dtype)
    idx, wts = route(x, gate_w, bias, top_k=TOP_K, n_group=N_GROUP, topk_group=TOPK_GROUP,
                     routed_scaling_factor=SCALE)
    flat_w = wts.reshape(-1).contiguous()
    tma_ok = torch.cuda.get_device_capability(x.device)[0] >= 9
    tried = []
    best = None
    for bm in block_m_candidates(num_tokens):
        if time.perf_counter() > deadline:
            break
        sorted_ids, expert_ids, total = moe_align(idx, NUM_EXPERTS, bm)
        align_ms = bench(lambda: moe_align(idx, NUM_EXPERTS, bm))

        def run1(cfg):
            return gate_up_stage(x, w_gate_up, sorted_ids, expert_ids, total, TOP_K, cfg)

        # gate/up: the tiles, then the best tile's shrinks, then the best of those through TMA
        stage1 = []
        if _time_candidates(stage1, [MoEConfig(BLOCK_M=bm, BLOCK_N1=bn, BLOCK_K1=bk, WARPS1=warps, STAGES1=stages)
                                     for bn, bk, warps, stages in TILES], run1, tried, 1) is None:
            continue
        _time_candidates(stage1, [dataclasses.replace(_best(stage1), SHRINK1=s) for s in shrink_candidates(bm)],
                         run1, tried, 1)
        if tma_ok:
            _time_candidates(stage1, [dataclasses.replace(_best(stage1), TMA1=1)], run1, tried, 1)
        ms1, cfg1 = min(stage1, key=lambda t: t[0])
        inter_buf = run1(cfg1)

        def run2(cfg):
            return down_stage(inter_buf, w_down, flat_w, sorted_ids, expert_ids, total, cfg)

        stage2 = []   # down: likewise, on the best gate/up output
        if _time_candidates(stage2, [dataclasses.replace(cfg1, BLOCK_N2=bn, BLOCK_K2=bk, WARPS2=warps, STAGES2=stages)
                                     for bn, bk, warps, stages in TILES], run2, tried, 2) is None:
            continue
        _time_candidates(stage2, [dataclasses.replace(_best(stage2), SHRINK2=s) for s in shrink_candidates(bm)],
                         run2, tried, 2)
        if tma_ok:
            _time_candidates(stage2, [dataclasses.replace(_best(stage2), TMA2=1)], run2, tried, 2)
        ms2, cfg2 = min(stage2, key=lambda t: t[0])
        tried.append({"BLOCK_M": bm, "align_ms": align_ms, "gate_up_ms": ms1, "down_ms": ms2,
                      "stage1": [[ms, dataclasses.asdict(c)] for ms, c in stage1],
                      "stage2": [[ms, dataclasses.asdict(c)] for ms, c in stage2]})
        if best is None or align_ms + ms1 + ms2 < best[0]:
            best = (align_ms + ms1 + ms2, cfg2)
    heuristic = heuristic_config(num_tokens * TOP_K, NUM_EXPERTS)
    reference = fused_moe(x, idx, wts, w_gate_up, w_down, config=heuristic)
    heuristic_ms = graph_ms(lambda: fused_moe(x, idx, wts, w_gate_up, w_down, config=heuristic))
    row = {"tokens": num_tokens, "heuristic": dataclasses.asdict(heuristic), "heuristic_ms": heuristic_ms,
           "tried": tried}
    if best is None:
        row.update(chosen=None, chosen_ms=None)
        return row
    cfg = best[1]
    out = fused_moe(x, idx, wts, w_gate_up, w_down, config=cfg)
    err = (out.float() - reference.float()).abs().max().item()
    tol = 2e-2 * max(1.0, reference.float().abs().max().item())
    tuned_ms = graph_ms(lambda: fused_moe(x, idx, wts, w_gate_up, w_down, config=cfg))
    row.update(candidate=dataclasses.asdict(cfg), candidate_ms=tuned_ms, max_abs_diff=err, ok=err <= tol)
    keep = err <= tol and tuned_ms < heuristic_ms
    row.update(chosen=dataclasses.asdict(cfg if keep else heuristic), chosen_ms=tuned_ms if keep else heuristic_ms)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="mini", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="32,512,1024,2048,4096")
    ap.add_argument("--budget-s", type=float, default=120.0, help="stop trying new BLOCK_M past this wall time")
    ap.add_argument("--out", default=None, help="table path (default: the one fused_moe reads for this GPU)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("moe_tune needs a CUDA GPU")
    from fluxlab.bench.moe_layer import measure_ceilings
    from fluxlab.kernels.moe_config import device_table_path, shape_key

    started = time.perf_counter()
    deadline = started + args.budget_s
    torch.manual_seed(0)
    hidden, inter = SHAPES[args.shape]
    device_name = torch.cuda.get_device_name()
    dev, bf = "cuda", torch.bfloat16
    with torch.inference_mode():
        ceilings = measure_ceilings()
        weights = (torch.randn(NUM_EXPERTS, 2 * inter, hidden, device=dev, dtype=bf) * hidden ** -0.5,
                   torch.randn(NUM_EXPERTS, hidden, inter, device=dev, dtype=bf) * inter ** -0.5)
        gate = (torch.randn(NUM_EXPERTS, hidden, device=dev, dtype=bf) * hidden ** -0.5,
                torch.randn(NUM_EXPERTS, device=dev) * 0.01)
        rows = []
        for t in [int(v) for v in args.tokens.split(",")]:
            row = tune_tokens(t, weights, gate, deadline)
            # floor: every expert's weights once (all 256 are hit from ~128 tokens) or the FLOPs
            weight_bytes = 3 * hidden * inter * 2 * NUM_EXPERTS * (1 - (1 - TOP_K / NUM_EXPERTS) ** t)
            flops = 2 * t * TOP_K * 3 * hidden * inter
            row["floor_ms"] = 1e3 * max(weight_bytes / ceilings["copy_bytes_per_s"],
                                        flops / ceilings["bf16_flops_per_s"])
            rows.append(row)
            print(f"T={t}: heuristic {row['heuristic_ms']:.3f} ms, tuned {row.get('candidate_ms') or float('nan'):.3f} ms, "
                  f"floor {row['floor_ms']:.3f} ms, wall {time.perf_counter() - started:.0f} s", flush=True)
    path = Path(args.out) if args.out else device_table_path(device_name)
    table = json.loads(path.read_text()) if path.is_file() else {}
    table.update(device=device_name, torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                 command=" ".join(["python -m fluxlab.bench.moe_tune", *(sys.argv[1:] if argv is None else argv)]))
    configs = table.setdefault("configs", {}).setdefault(shape_key(NUM_EXPERTS, hidden, inter, TOP_K, bf), {})
    for row in rows:
        if row["chosen"] is not None:
            configs[str(row["tokens"])] = {**row["chosen"], "ms": round(row["chosen_ms"], 4),
                                           "heuristic_ms": round(row["heuristic_ms"], 4)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "moe_tune.json").write_text(json.dumps({"ceilings": ceilings, "rows": rows}, indent=1))
    print(f"\nwrote {path}\n")
    print("| tokens | heuristic ms | tuned ms | floor ms | tuned / floor | config (BM, N1/K1/W1/S1/shrink1/tma1, "
          "N2/K2/W2/S2/shrink2/tma2) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        c = row["chosen"] or {}
        print(f"| {row['tokens']} | {row['heuristic_ms']:.3f} | {row['chosen_ms'] or float('nan'):.3f} | "
              f"{row['floor_ms']:.3f} | {(row['chosen_ms'] or float('nan')) / row['floor_ms']:.2f} | "
              f"{c.get('BLOCK_M')}, {c.get('BLOCK_N1')}/{c.get('BLOCK_K1')}/{c.get('WARPS1')}/{c.get('STAGES1')}/"
              f"{c.get('SHRINK1')}/{c.get('TMA1')}, {c.get('BLOCK_N2')}/{c.get('BLOCK_K2')}/{c.get('WARPS2')}/"
              f"{c.get('STAGES2')}/{c.get('SHRINK2')}/{c.get('TMA2')} |")
    return {"rows": rows}


if __name__ == "__main__":
    main()
