"""MoE layer micro-benchmark (GPU only): `python -m fluxlab.kernels.bench_moe [--sweep]`.

For LLaDA2.0-mini (H=2048, I=512) and flash (H=4096, I=1024) expert shapes, E=256, top-8, bf16,
random weights and routing from the real router (`route`, random gate weights), at T tokens:

  mm      moe_forward(use_grouped_mm=True)  eager only (it syncs: bincount reads the max back)
  gmm     grouped_mm_moe                    eager and CUDA graph
  fused   fused_moe (Triton)                eager and CUDA graph

Checks max abs error of gmm and fused against moe_forward. Floor = max(bytes / copy bandwidth,
FLOPs / bf16 matmul rate), both ceilings measured in this run (D2D copy of 2 GiB, 8192^3 matmul);
bytes = weights of the distinct experts hit + x read + out written; FLOPs = 2*T*K*3*H*I.
Prints a table and writes $OUT/moe_bench.json when OUT is set. `--sweep` also times a few
fused_moe tile configs per (shape, T) under a graph and reports the best (slower: one JIT each).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch

SHAPES = {"mini": (2048, 512), "flash": (4096, 1024)}
NUM_EXPERTS, TOP_K, N_GROUP, TOPK_GROUP, SCALE = 256, 8, 8, 4, 2.5


def _time_eager(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _time_graph(fn, iters: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    del graph
    return ms


def measure_ceilings() -> dict:
    n = 1 << 30  # 1 Gi bf16 elements = 2 GiB
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = min(_time_eager(lambda: dst.copy_(src), 5) for _ in range(2))
    copy_bw = 2 * src.numel() * src.element_size() / (ms * 1e-3)  # read + write, bytes/s
    del src, dst
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    ms = min(_time_eager(lambda: a @ b, 5) for _ in range(2))
    mm_rate = 2 * m ** 3 / (ms * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": copy_bw, "bf16_flops_per_s": mm_rate}


def _sweep_configs():
    from fluxlab.kernels.fused_moe import MoEConfig
    out = []
    for bm in (16, 32, 64):
        for bn, bk, w, st in ((64, 128, 4, 3), (64, 128, 4, 4), (128, 64, 4, 3), (128, 64, 8, 4), (32, 256, 4, 3)):
            out.append(MoEConfig(BLOCK_M=bm, BLOCK_N1=bn, BLOCK_K1=bk, WARPS1=w, STAGES1=st,
                                 BLOCK_N2=bn, BLOCK_K2=bk, WARPS2=w, STAGES2=st, GROUP_M=8))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mini,flash")
    ap.add_argument("--tokens", default="32,256,512,1024,2048")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time candidate fused_moe tile configs")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe needs a CUDA GPU")

    from fluxlab.engine.layers.moe import moe_forward, route
    from fluxlab.kernels.fused_moe import default_config, fused_moe, grouped_mm_moe

    t_start = time.time()
    torch.manual_seed(0)
    dev = "cuda"
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import triton
        result["triton"] = triton.__version__
    except Exception:
        result["triton"] = None
    with torch.inference_mode():
        ceil = measure_ceilings()
        result.update(ceil)
        print(f"{result['device']}  torch {torch.__version__}  triton {result['triton']}  "
              f"copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s  bf16 mm {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s")
        rows = []
        hdr = (f"{'shape':6} {'T':>5} {'hit':>4} | {'mm':>7} | {'gmm':>7} {'gmm_g':>7} | {'fused':>7} {'fused_g':>7} "
               f"| {'floor':>6} {'best/fl':>7} | {'err_gmm':>8} {'err_fus':>8} cfg")
        print(hdr)
        print("-" * len(hdr))
        for shape in args.shapes.split(","):
            hidden, inter = SHAPES[shape]
            w_gate_up = (torch.randn(NUM_EXPERTS, 2 * inter, hidden, device=dev, dtype=torch.bfloat16)
                         * hidden ** -0.5)
            w_down = torch.randn(NUM_EXPERTS, hidden, inter, device=dev, dtype=torch.bfloat16) * inter ** -0.5
            gate_w = torch.randn(NUM_EXPERTS, hidden, device=dev, dtype=torch.bfloat16) * hidden ** -0.5
            bias = torch.randn(NUM_EXPERTS, device=dev) * 0.01
            for t in [int(v) for v in args.tokens.split(",")]:
                x = torch.randn(t, hidden, device=dev, dtype=torch.bfloat16)
                idx, wts = route(x, gate_w, bias, top_k=TOP_K, n_group=N_GROUP, topk_group=TOPK_GROUP,
                                 routed_scaling_factor=SCALE)
                hit = int(torch.unique(idx).numel())
                ref = moe_forward(x, idx, wts, w_gate_up, w_down, use_grouped_mm=True)
                ref_max = ref.float().abs().max().item()

                def err(out):
                    return (out.float() - ref.float()).abs().max().item()

                row = {"shape": shape, "hidden": hidden, "inter": inter, "T": t, "experts_hit": hit}
                cfg = default_config(t, TOP_K, NUM_EXPERTS, hidden, inter, torch.bfloat16, torch.device(dev))
                row["fused_config"] = dataclasses.asdict(cfg)
                row["ref_max_abs"] = ref_max
                row["err_gmm"] = err(grouped_mm_moe(x, idx, wts, w_gate_up, w_down))
                row["err_fused"] = err(fused_moe(x, idx, wts, w_gate_up, w_down))
                it = args.iters
                row["mm_ms"] = _time_eager(lambda: moe_forward(x, idx, wts, w_gate_up, w_down, use_grouped_mm=True), it)
                row["gmm_ms"] = _time_eager(lambda: grouped_mm_moe(x, idx, wts, w_gate_up, w_down), it)
                row["fused_ms"] = _time_eager(lambda: fused_moe(x, idx, wts, w_gate_up, w_down), it)
                for key, fn in (("gmm_graph_ms", lambda: grouped_mm_moe(x, idx, wts, w_gate_up, w_down)),
                                ("fused_graph_ms", lambda: fused_moe(x, idx, wts, w_gate_up, w_down))):
                    try:
                        row[key] = _time_graph(fn, it)
                    except Exception as exc:  # report, keep going
                        row[key] = None
                        row[key.replace("_ms", "_error")] = repr(exc)[:300]
                bytes_ = hit * 3 * hidden * inter * 2 + 2 * t * hidden * 2
                flops = 2 * t * TOP_K * 3 * hidden * inter
                row["floor_ms"] = max(bytes_ / ceil["copy_bytes_per_s"], flops / ceil["bf16_flops_per_s"]) * 1e3
                times = [row[k] for k in ("mm_ms", "gmm_ms", "gmm_graph_ms", "fused_ms", "fused_graph_ms")
                         if row.get(k) is not None]
                row["best_ms"] = min(times)
                row["best_over_floor"] = row["best_ms"] / row["floor_ms"]
                row["fused_graph_over_floor"] = (row["fused_graph_ms"] / row["floor_ms"]
                                                 if row.get("fused_graph_ms") else None)
                tol = 2e-2 * max(1.0, ref_max)
                row["ok"] = row["err_gmm"] <= tol and row["err_fused"] <= tol

                if args.sweep:
                    sweep = []
                    for c in _sweep_configs():
                        try:
                            e = err(fused_moe(x, idx, wts, w_gate_up, w_down, config=c))
                            ms = _time_graph(lambda c=c: fused_moe(x, idx, wts, w_gate_up, w_down, config=c), it)
                            sweep.append({"config": dataclasses.asdict(c), "graph_ms": ms, "err": e})
                        except Exception as exc:
                            sweep.append({"config": dataclasses.asdict(c), "error": repr(exc)[:300]})
                    row["sweep"] = sweep
                    good = [s for s in sweep if "graph_ms" in s]
                    if good:
                        row["sweep_best"] = min(good, key=lambda s: s["graph_ms"])

                rows.append(row)

                def f(v):
                    return f"{v:7.3f}" if v is not None else "    n/a"

                print(f"{shape:6} {t:5d} {hit:4d} | {f(row['mm_ms'])} | {f(row['gmm_ms'])} {f(row['gmm_graph_ms'])} | "
                      f"{f(row['fused_ms'])} {f(row['fused_graph_ms'])} | {row['floor_ms']:6.3f} "
                      f"{row['best_over_floor']:7.2f} | {row['err_gmm']:8.2e} {row['err_fused']:8.2e} "
                      f"BM{cfg.BLOCK_M}{'' if row['ok'] else '  ERR>TOL'}", flush=True)
                if args.sweep and row.get("sweep_best"):
                    sb = row["sweep_best"]
                    c = sb["config"]
                    print(f"        sweep best {sb['graph_ms']:.3f} ms: BM{c['BLOCK_M']} BN{c['BLOCK_N1']} "
                          f"BK{c['BLOCK_K1']} W{c['WARPS1']}", flush=True)
            del w_gate_up, w_down
            torch.cuda.empty_cache()
    result["rows"] = rows
    result["wall_s"] = time.time() - t_start
    print(f"ms per MoE layer call (mm/gmm/fused eager, *_g = CUDA-graph replay); floor = max(bytes/copy BW, "
          f"FLOPs/mm rate); wall {result['wall_s']:.1f} s")
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "moe_bench.json"), "w") as fh:
            json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()
