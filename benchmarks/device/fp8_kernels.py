"""FP8 kernels on one GPU (issue 38): the block-scaled fused MoE and GEMM against their bf16 counterparts.

`python3 benchmarks/device/fp8_kernels.py [OUT.json]` (step `fp8`). LLaDA2.0-mini shapes, random weights made on the
GPU, uniform random top-8 routing, ms a call under CUDA-graph replay (median of 5 replays of 20 calls). Every variant
is first checked against the dequantize -> matmul reference (relative error printed). Floors: bytes / the copy
bandwidth measured here (weights of the experts hit + activations in and out).
"""
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from fluxlab.engine.layers.fp8 import fp8_linear_reference, fp8_moe_reference, quantize_blocks, quantize_stacked
from fluxlab.kernels.fp8_gemm import fp8_matmul, quantize_act
from fluxlab.kernels.fp8_moe import FP8MoEConfig, fp8_fused_moe
from fluxlab.kernels.fused_moe import fused_moe

dev = "cuda"
E, H, I, K = 256, 2048, 512, 8


def graph_ms(fn, iters=20, reps=5):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return statistics.median(times)


def copy_bw():
    x = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    ms = graph_ms(lambda: y.copy_(x), iters=5)
    return 2 * x.numel() / ms / 1e9  # TB/s


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/fp8_kernels.json"
    torch.manual_seed(0)
    bw = copy_bw()
    print(f"copy bandwidth {bw:.2f} TB/s", flush=True)
    rows = []
    # ------------------------------------------------------------------ MoE layer
    w_gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * H ** -0.5
    w_down = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * I ** -0.5
    wgu, sgu = quantize_stacked(w_gate_up, 2)
    wd, sd = quantize_blocks(w_down)
    configs = {
        "m16n128": FP8MoEConfig(),
        "m16n64": FP8MoEConfig(BLOCK_N2=64),
        "m16n128s4": FP8MoEConfig(STAGES1=4, STAGES2=4),
        "m16n128s5": FP8MoEConfig(STAGES1=5, STAGES2=5),
        "m32n128": FP8MoEConfig(BLOCK_M=32),
        "m64n128": FP8MoEConfig(BLOCK_M=64),
        "m64n128w8": FP8MoEConfig(BLOCK_M=64, WARPS1=8, WARPS2=8),
        "m64n128s4": FP8MoEConfig(BLOCK_M=64, STAGES1=4, STAGES2=4),
        "m64n256w8": FP8MoEConfig(BLOCK_M=64, BLOCK_N2=256, WARPS2=8),
        "m128n128w8": FP8MoEConfig(BLOCK_M=128, WARPS1=8, WARPS2=8),
        "m32n128s4": FP8MoEConfig(BLOCK_M=32, STAGES1=4, STAGES2=4),
    }
    for tokens in (32, 512, 2048):
        x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)
        idx = torch.rand(tokens, E, device=dev).topk(K, dim=-1).indices
        wts = torch.rand(tokens, K, device=dev) + 0.05
        hit = idx.unique().numel()
        floor_bf16 = (hit * 3 * I * H * 2 + 2 * tokens * H * 2) / bw / 1e9
        floor_fp8 = (hit * 3 * I * H + 2 * tokens * H * 2) / bw / 1e9
        n_ref = min(tokens, 64)
        ref = fp8_moe_reference(x[:n_ref].cpu(), idx[:n_ref].cpu(), wts[:n_ref].cpu(), wgu.cpu(), sgu.cpu(), wd.cpu(),
                                sd.cpu())
        bf16_ms = graph_ms(lambda: fused_moe(x, idx, wts, w_gate_up, w_down))
        q_ms = graph_ms(lambda: quantize_act(x))
        rows.append(dict(kind="quantize_act", tokens=tokens, variant="fp8", ms=q_ms))
        print(f"quantize_act T={tokens} [{tokens}, {H}]: {q_ms:.4f} ms", flush=True)
        rows.append(dict(kind="moe", tokens=tokens, variant="bf16 fused_moe (tuned)", ms=bf16_ms, floor=floor_bf16))
        print(f"moe T={tokens} bf16 {bf16_ms:.3f} ms (floor {floor_bf16:.3f}); fp8 floor {floor_fp8:.3f}", flush=True)
        for name, cfg in configs.items():
            try:
                got = fp8_fused_moe(x, idx, wts, wgu, sgu, wd, sd, config=cfg)
                err = rel(got[:n_ref].cpu(), ref)
                ms = graph_ms(lambda: fp8_fused_moe(x, idx, wts, wgu, sgu, wd, sd, config=cfg))
            except Exception as exc:  # a config that does not compile is reported, not fatal
                print(f"moe T={tokens} {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            rows.append(dict(kind="moe", tokens=tokens, variant=f"fp8 {name}", ms=ms, floor=floor_fp8, rel_err=err))
            print(f"moe T={tokens} fp8 {name}: {ms:.3f} ms, rel err {err:.2e}", flush=True)
    # ------------------------------------------------------------------ dense GEMMs
    shapes = {"qkv": (3072, 2048), "dense": (2048, 2048), "shared gate": (512, 2048), "shared down": (2048, 512),
              "mlp0 gate": (5120, 2048), "mlp0 down": (2048, 5120)}
    tiles = {"m64n64s4": (64, 64, 4, 4), "m64n128s3": (64, 128, 4, 3), "m64n32s4": (64, 32, 4, 4),
             "m128n128w8": (128, 128, 8, 3), "m32n64s4": (32, 64, 4, 4), "m16n64s4": (16, 64, 4, 4),
             "m128n64w4": (128, 64, 4, 4), "m64n128w8s4": (64, 128, 8, 4), "m16n128s4": (16, 128, 4, 4)}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5
        q, s = quantize_blocks(w)
        for tokens in (32, 512, 2048):
            x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
            ref = fp8_linear_reference(x[:64].cpu(), q.cpu(), s.cpu(), torch.float32)
            floor = (n * k + 2 * tokens * (n + k)) / bw / 1e9
            bf16_ms = graph_ms(lambda: F.linear(x, w))
            rows.append(dict(kind="gemm", shape=name, tokens=tokens, variant="bf16 cuBLAS", ms=bf16_ms,
                             floor=floor + n * k / bw / 1e9))
            line = [f"{name:12s} T={tokens:5d} bf16 {bf16_ms:.4f}"]
            for tname, t in tiles.items():
                try:
                    err = rel(fp8_matmul(x[:64], q, s, torch.float32, tiles=t).cpu(), ref)
                    ms = graph_ms(lambda: fp8_matmul(x, q, s, tiles=t))
                except Exception as exc:
                    line.append(f"{tname} {type(exc).__name__}")
                    continue
                rows.append(dict(kind="gemm", shape=name, tokens=tokens, variant=f"fp8 {tname}", ms=ms, floor=floor,
                                 rel_err=err))
                line.append(f"{tname} {ms:.4f} ({err:.0e})")
            print(" | ".join(line) + f" | fp8 floor {floor:.4f}", flush=True)
    json.dump(dict(bandwidth_tb_s=bw, device=torch.cuda.get_device_name(), rows=rows), open(out_path, "w"), indent=1)
    # ------------------------------------------------------------------ table
    print("\n| kind | shape | tokens | best fp8 variant | fp8 ms | bf16 ms | fp8 floor ms |")
    print("|---|---|---|---|---|---|---|")
    keyf = lambda r: (r["kind"], r.get("shape", "moe"), r["tokens"])  # noqa: E731
    for key in sorted({keyf(r) for r in rows}):
        group = [r for r in rows if keyf(r) == key]
        fp8 = [r for r in group if r["variant"].startswith("fp8")]
        bf16 = [r for r in group if not r["variant"].startswith("fp8")]
        if fp8 and bf16:
            best = min(fp8, key=lambda r: r["ms"])
            print(f"| {key[0]} | {key[1]} | {key[2]} | {best['variant']} | {best['ms']:.4f} | {bf16[0]['ms']:.4f} | "
                  f"{best['floor']:.4f} |")


if __name__ == "__main__":
    main()
