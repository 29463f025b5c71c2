"""MoE layer micro-benchmark (GPU only): `python -m fluxlab.bench.moe_layer [--sweep]`.

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

`--old-vs-new` (mini shape, --tokens) times, in one run, the previous kernel (the scan align,
`moe_align_scan`, with the GPU's table config and no row-tile shrink) against the counting-sort
align with that config, with SHRINK1/SHRINK2 (also at twice the table's BLOCK_M) and with TMA1/TMA2
(sm90+; with and without a shrink), each a whole
layer under CUDA-graph replay, plus each variant's align / gate-up / down alone (do_bench), the
floor beside each; "same bits" says whether a variant's output equals, bit for bit, the previous
kernel's at the same BLOCK_M without shrink (a row's value must not depend on the height of the
tile it lands in, which depends on the other tokens). `--write-table PATH` writes the
GPU's table with, per token count, the fastest variant with both properties where it beats the
previous kernel. Writes $OUT/moe_old_vs_new.json when OUT is set.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
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
    from fluxlab.kernels.moe_config import MoEConfig
    out = []
    for bm in (16, 32, 64):
        for bn, bk, w, st in ((64, 128, 4, 3), (64, 128, 4, 4), (128, 64, 4, 3), (128, 64, 8, 4), (32, 256, 4, 3)):
            out.append(MoEConfig(BLOCK_M=bm, BLOCK_N1=bn, BLOCK_K1=bk, WARPS1=w, STAGES1=st,
                                 BLOCK_N2=bn, BLOCK_K2=bk, WARPS2=w, STAGES2=st, GROUP_M=8))
    return out


def _floor_ms(ceil: dict, num_tokens: int, experts_hit: int, hidden: int, inter: int) -> float:
    """max(weights of the experts hit + x read + out written / copy BW, FLOPs / bf16 mm rate)."""
    bytes_ = experts_hit * 3 * hidden * inter * 2 + 2 * num_tokens * hidden * 2
    flops = 2 * num_tokens * TOP_K * 3 * hidden * inter
    return max(bytes_ / ceil["copy_bytes_per_s"], flops / ceil["bf16_flops_per_s"]) * 1e3


def probe_batches(hidden: int, num_experts: int = 256, top_k: int = 8, sizes=(2048, 512), num_probes: int = 16,
                  device="cuda", dtype=torch.bfloat16, seed: int = 5) -> list:
    """The same probe tokens (routed to experts 0..top_k-1) in batches whose other tokens leave those
    experts nearly empty (short, shrunk last tiles), fill them (full tiles, the probes last), or
    make a smaller batch -> [(x, topk_idx, topk_weight, probe rows)]. A kernel whose row values
    depend on the tile they land in gives the probes different outputs across these batches."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def tokens(n, experts):
        return (torch.randn(n, hidden, device=device, dtype=dtype, generator=gen), experts,
                torch.rand(n, top_k, device=device, generator=gen) + 0.05)

    probes = tokens(num_probes, torch.stack([torch.randperm(top_k, device=device, generator=gen)
                                             for _ in range(num_probes)]))
    batches = []
    for n, fill, probes_first in ((sizes[0], False, True), (sizes[0], True, False), (sizes[1], True, True)):
        experts = top_k + torch.stack([torch.randperm(num_experts - top_k, device=device, generator=gen)[:top_k]
                                       for _ in range(n - num_probes)])
        if fill:   # every other token also takes one of the probes' experts (~n/top_k rows each)
            experts[:, 0] = torch.arange(n - num_probes, device=device) % top_k
        parts = [probes, tokens(n - num_probes, experts)]
        rows = slice(0, num_probes) if probes_first else slice(n - num_probes, n)
        batches.append(tuple(torch.cat(t) for t in zip(*(parts if probes_first else parts[::-1]))) + (rows,))
    return batches


def _variants(base):
    """(name, config, align) to time against the previous kernel (base: the table's config, no shrink)."""
    from fluxlab.kernels.moe_config import MoEConfig
    from fluxlab.kernels.moe_align import moe_align, moe_align_scan

    out = [("old", base, moe_align_scan), ("new align", base, moe_align)]
    if torch.cuda.get_device_capability()[0] >= 9:   # weight tiles through TMA, with and without a shrink
        for shrink in (0, 1) if base.BLOCK_M >= 32 else (0,):
            cfg = dataclasses.replace(base, SHRINK1=shrink, SHRINK2=shrink, TMA1=1, TMA2=1)
            out.append((f"BM{base.BLOCK_M} {f'shrink{shrink} ' if shrink else ''}tma", cfg, moe_align))
    for bm in sorted({base.BLOCK_M, min(128, 2 * base.BLOCK_M)}):
        # twice the rows per tile with the table's 4-stage tiles is past the 227 KB of shared memory
        stages = {} if bm == base.BLOCK_M else {"STAGES1": min(3, base.STAGES1), "STAGES2": min(3, base.STAGES2)}
        for shrink in (1, 2):
            if bm >> shrink >= 16:
                cfg = MoEConfig(**{**dataclasses.asdict(base), "BLOCK_M": bm, "SHRINK1": shrink, "SHRINK2": shrink,
                                   **stages})
                out.append((f"BM{bm} shrink{shrink}", cfg, moe_align))
    return out


def _old_vs_new_row(t: int, iters: int, ceil: dict, weights, probes, dev, bf) -> dict:
    import triton

    from fluxlab.engine.layers.moe import moe_forward, route
    from fluxlab.kernels.fused_moe import down_stage, fused_moe, gate_up_stage
    from fluxlab.kernels.moe_config import default_config
    from fluxlab.kernels.moe_align import moe_align_scan

    w_gate_up, w_down, gate_w, bias = weights
    hidden, inter = w_gate_up.shape[2], w_down.shape[2]
    x = torch.randn(t, hidden, device=dev, dtype=bf)
    idx, wts = route(x, gate_w, bias, top_k=TOP_K, n_group=N_GROUP, topk_group=TOPK_GROUP,
                     routed_scaling_factor=SCALE)
    flat_w = wts.reshape(-1).contiguous()
    hit = int(torch.unique(idx).numel())
    ref = moe_forward(x, idx, wts, w_gate_up, w_down).float()
    tol = 2e-2 * max(1.0, ref.abs().max().item())
    table_cfg = default_config(t, TOP_K, NUM_EXPERTS, hidden, inter, bf, x.device)
    base = dataclasses.replace(table_cfg, SHRINK1=0, SHRINK2=0)
    full_height = {}
    row = {"tokens": t, "experts_hit": hit, "floor_ms": _floor_ms(ceil, t, hit, hidden, inter),
           "table_config": dataclasses.asdict(table_cfg), "variants": []}
    for name, cfg, align in _variants(base):
        entry = {"name": name, "config": dataclasses.asdict(cfg)}
        try:
            out = fused_moe(x, idx, wts, w_gate_up, w_down, config=cfg, align=align)
            # A shrink must not change a value (else a token's output would depend on how many
            # other tokens share its experts): compare with the same BLOCK_M at full height; the
            # new align with the previous kernel's output.
            full_cfg = dataclasses.replace(cfg, SHRINK1=0, SHRINK2=0)
            if full_cfg not in full_height:
                full_height[full_cfg] = fused_moe(x, idx, wts, w_gate_up, w_down, config=full_cfg,
                                                  align=moe_align_scan)
            entry["same_bits"] = bool(torch.equal(out, full_height[full_cfg]))
            probe_outs = [fused_moe(px, pidx, pw, w_gate_up, w_down, config=cfg, align=align)[rows]
                          for px, pidx, pw, rows in probes]
            entry["batch_invariant"] = all(torch.equal(o, probe_outs[0]) for o in probe_outs[1:])
            entry["err"] = (out.float() - ref).abs().max().item()
            entry["ok"] = entry["err"] <= tol
            entry["graph_ms"] = _time_graph(lambda: fused_moe(x, idx, wts, w_gate_up, w_down, config=cfg,
                                                              align=align), iters)
            sorted_ids, expert_ids, total = align(idx, NUM_EXPERTS, cfg.BLOCK_M)
            inter_buf = gate_up_stage(x, w_gate_up, sorted_ids, expert_ids, total, TOP_K, cfg)
            bench = functools.partial(triton.testing.do_bench, warmup=10, rep=40, return_mode="median")
            entry["align_ms"] = bench(lambda: align(idx, NUM_EXPERTS, cfg.BLOCK_M))
            entry["gate_up_ms"] = bench(lambda: gate_up_stage(x, w_gate_up, sorted_ids, expert_ids, total, TOP_K,
                                                              cfg))
            entry["down_ms"] = bench(lambda: down_stage(inter_buf, w_down, flat_w, sorted_ids, expert_ids, total,
                                                        cfg))
        except Exception as exc:  # report, keep going
            entry["error"] = repr(exc)[:300]
        row["variants"].append(entry)
    good = [v for v in row["variants"][1:] if v.get("graph_ms") and v["same_bits"] and v["batch_invariant"]
            and v["ok"]]
    row["best"] = min(good, key=lambda v: v["graph_ms"]) if good else None
    for v in row["variants"]:
        if "error" in v:
            print(f"T={t} {v['name']}: {v['error']}", flush=True)
        else:
            print(f"T={t:5d} {v['name']:16} {v['graph_ms']:.3f} ms (align {v['align_ms']:.3f}, gate-up "
                  f"{v['gate_up_ms']:.3f}, down {v['down_ms']:.3f}) same bits {v['same_bits']} batch-invariant "
                  f"{v['batch_invariant']} err {v['err']:.2e}",
                  flush=True)
    del x, idx, wts, ref
    return row


def old_vs_new(tokens: list[int], iters: int, table_out: str | None, device: str = "cuda",
               dtype: torch.dtype = torch.bfloat16) -> dict:
    import triton

    from fluxlab.kernels.moe_config import device_table_path, shape_key

    torch.manual_seed(0)
    dev, bf = device, dtype
    hidden, inter = SHAPES["mini"]
    ceil = measure_ceilings()
    w_gate_up = torch.randn(NUM_EXPERTS, 2 * inter, hidden, device=dev, dtype=bf) * hidden ** -0.5
    w_down = torch.randn(NUM_EXPERTS, hidden, inter, device=dev, dtype=bf) * inter ** -0.5
    gate_w = torch.randn(NUM_EXPERTS, hidden, device=dev, dtype=bf) * hidden ** -0.5
    bias = torch.randn(NUM_EXPERTS, device=dev) * 0.01
    probes = probe_batches(hidden, NUM_EXPERTS, TOP_K, device=dev, dtype=bf)
    rows = []
    try:
        for t in tokens:
            rows.append(_old_vs_new_row(t, iters, ceil, (w_gate_up, w_down, gate_w, bias), probes, dev, bf))
    except KeyboardInterrupt:   # `timeout -s INT`: keep the rows measured so far
        print(f"interrupted after {len(rows)} token counts", flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              **ceil, "rows": rows}
    if table_out:
        path = device_table_path(torch.cuda.get_device_name())
        table = json.loads(path.read_text()) if path.is_file() else {}
        configs = table.setdefault("configs", {}).setdefault(shape_key(NUM_EXPERTS, hidden, inter, TOP_K, bf), {})
        for row in rows:
            best, old = row["best"], row["variants"][0]
            if best and old.get("graph_ms") and best["graph_ms"] < old["graph_ms"]:
                configs[str(row["tokens"])] = {**best["config"], "ms": round(best["graph_ms"], 4),
                                               "previous_kernel_ms": round(old["graph_ms"], 4)}
        table.update(date=time.strftime("%Y-%m-%d"), command=f"python -m fluxlab.bench.moe_layer --old-vs-new "
                     f"--tokens {','.join(map(str, tokens))} (SHRINK on top of the tuned tiles)")
        os.makedirs(os.path.dirname(os.path.abspath(table_out)), exist_ok=True)
        with open(table_out, "w") as fh:
            fh.write(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"wrote {table_out}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "moe_old_vs_new.json"), "w") as fh:
            json.dump(result, fh, indent=1)
    print(f"\n{result['device']}, copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 mm "
          f"{ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s; ms per MoE layer (E 256, H 2048, I 512, top-8), CUDA-graph "
          "replay; old = scan align + table config; new = counting-sort align + the fastest variant that keeps the "
          "full-height bits and is batch-invariant")
    print("| tokens | floor ms | old ms | new align ms | new ms | variant | new / old | old / floor | new / floor "
          "| align old / new ms | gate-up old / new ms | down old / new ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        old, new_align, best = row["variants"][0], row["variants"][1], row["best"] or {}

        def f(v, key):
            return f"{v[key]:.3f}" if v.get(key) is not None else "n/a"

        ratio = (f"{best['graph_ms'] / old['graph_ms']:.2f}" if best.get("graph_ms") and old.get("graph_ms")
                 else "n/a")
        fl = row["floor_ms"]
        print(f"| {row['tokens']} | {fl:.3f} | {f(old, 'graph_ms')} | {f(new_align, 'graph_ms')} | "
              f"{f(best, 'graph_ms')} | {best.get('name', 'n/a')} | {ratio} | "
              f"{old['graph_ms'] / fl if old.get('graph_ms') else float('nan'):.2f} | "
              f"{best['graph_ms'] / fl if best.get('graph_ms') else float('nan'):.2f} | "
              f"{f(old, 'align_ms')} / {f(best, 'align_ms')} | {f(old, 'gate_up_ms')} / {f(best, 'gate_up_ms')} | "
              f"{f(old, 'down_ms')} / {f(best, 'down_ms')} |")
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mini,flash")
    ap.add_argument("--tokens", default="32,256,512,1024,2048")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time candidate fused_moe tile configs")
    ap.add_argument("--old-vs-new", action="store_true",
                    help="time the previous kernel (scan align, no shrink) against the new align and shrinks")
    ap.add_argument("--write-table", default=None, help="with --old-vs-new: write the table with the picks here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fluxlab.bench.moe_layer needs a CUDA GPU")
    if args.old_vs_new:
        with torch.inference_mode():
            return old_vs_new([int(v) for v in args.tokens.split(",")], args.iters, args.write_table)

    from fluxlab.engine.layers.moe import moe_forward, route
    from fluxlab.kernels.fused_moe import fused_moe, grouped_mm_moe
    from fluxlab.kernels.moe_config import default_config

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
