"""Tile sweep of Diffusion-Gemma's fused bf16 MoE (gelu-tanh) at 26B-A4B shapes (GPU), for a per-batch config.

The canvas MoE's config follows the token count (layers.canvas_moe_config) only where a token's output
does not depend on it; at batch 16 it is 2.4x its FLOP floor (docs/benchmarks.md). A config chosen
by token count keeps that property only if it gives every token the bits the batch-1 config gives.
This times candidate configs at 256 tokens (one canvas, 2048 slots), 1024 and 4096 (16 canvases) and
checks, for each, whether the first canvas's rows inside the batch equal that canvas run alone through
the one-canvas config, bit for bit. Random bf16 weights (E 128, top-8, H 2816, I 704), random routing.
`--fp8`: the same for the FP8 fused MoE (kernels/fp8_moe.py, weights quantized to e4m3 with 128x128 block
scales), whose candidates keep 64+-row tiles (wgmma; kernels/fp8_moe.py FP8MoEConfig). SHAPESET=llada with --fp8:
LLaDA2.0-mini's experts (E 256, top-8, H 2048, I 512, SiLU) at 32 tokens (a batch-1 decode forward) and 2048 (batch
64), the bits against the 32 tokens alone.
Usage: python3 benchmarks/device/diffusion_gemma_moe_tiles.py [--fp8] [out.json]
"""
import dataclasses
import json
import os
import sys

import torch
from triton.testing import do_bench

from fluxlab.engine.layers.fp8 import quantize_blocks, quantize_stacked
from fluxlab.kernels.fp8_moe import FP8MoEConfig, fp8_fused_moe
from fluxlab.kernels.fused_moe import fused_moe
from fluxlab.models.diffusion_gemma.layers import canvas_moe_config

E, TOP_K, H, I = 128, 8, 2816, 704
CANVAS, TOKENS = 256, (256, 1024, 4096)
ACTIVATION = "gelu_tanh"
if os.environ.get("SHAPESET") == "llada":
    E, TOP_K, H, I = 256, 8, 2048, 512
    CANVAS, TOKENS, ACTIVATION = 32, (32, 2048), "silu"
DEVICE = "cuda"
CURRENT = canvas_moe_config(CANVAS)
R = dataclasses.replace
CANDIDATES = {
    "current": CURRENT,
    "s4": R(CURRENT, STAGES1=4, STAGES2=4),
    "s4 tma": R(CURRENT, STAGES1=4, STAGES2=4, TMA1=1, TMA2=1),
    "bm32 s4": R(CURRENT, BLOCK_M=32, SHRINK1=1, SHRINK2=1, STAGES1=4, STAGES2=4),
    "k64 s4": R(CURRENT, BLOCK_K1=64, STAGES1=4),
    "k64 s4 d-s4": R(CURRENT, BLOCK_K1=64, STAGES1=4, STAGES2=4),
    "k64 s5": R(CURRENT, BLOCK_K1=64, STAGES1=5),
    "k64 s4 g16": R(CURRENT, BLOCK_K1=64, STAGES1=4, GROUP_M=16),
    "n128 k64": R(CURRENT, BLOCK_N1=128, BLOCK_K1=64),
    "n128 k64 w8 s4": R(CURRENT, BLOCK_N1=128, BLOCK_K1=64, WARPS1=8, STAGES1=4),
    "bm128 k64 s4": R(CURRENT, BLOCK_M=128, SHRINK1=1, SHRINK2=1, BLOCK_K1=64, STAGES1=4),
    "bm128 n128 k64 w8": R(CURRENT, BLOCK_M=128, SHRINK1=1, SHRINK2=1, BLOCK_N1=128, BLOCK_K1=64, WARPS1=8,
                           WARPS2=8),
    "bm128 k64 d256 w8": R(CURRENT, BLOCK_M=128, SHRINK1=1, SHRINK2=1, BLOCK_K1=64, STAGES1=4, BLOCK_N2=256,
                           WARPS2=8),
}
FP8_CURRENT = FP8MoEConfig()
FP8_CANDIDATES = {
    "current": FP8_CURRENT,
    "s4": R(FP8_CURRENT, STAGES1=4, STAGES2=4),
    "w4": R(FP8_CURRENT, WARPS1=4, WARPS2=4),
    "w4 s4": R(FP8_CURRENT, WARPS1=4, WARPS2=4, STAGES1=4, STAGES2=4),
    "w4 s5": R(FP8_CURRENT, WARPS1=4, WARPS2=4, STAGES1=5, STAGES2=5),
    "g16": R(FP8_CURRENT, GROUP_M=16),
    "g16 w4 s4": R(FP8_CURRENT, GROUP_M=16, WARPS1=4, WARPS2=4, STAGES1=4, STAGES2=4),
    "g1": R(FP8_CURRENT, GROUP_M=1),
    "d64": R(FP8_CURRENT, BLOCK_N2=64),
    "d64 w4 s4": R(FP8_CURRENT, BLOCK_N2=64, WARPS1=4, WARPS2=4, STAGES1=4, STAGES2=4),
    "d256": R(FP8_CURRENT, BLOCK_N2=256),
    "w4 s4 d256 w8": R(FP8_CURRENT, WARPS1=4, STAGES1=4, BLOCK_N2=256),
    "bm128": R(FP8_CURRENT, BLOCK_M=128),
    "s2": R(FP8_CURRENT, STAGES1=2, STAGES2=2),
    # 128-row tiles over 16 warps: one tile an expert at ~72 rows (LLaDA b64) or 256 (DG b16); at 8 warps gate/up
    # takes 255 registers, at 16 128 (sm90 offline, triton 3.6.0)
    "bm128 w16": R(FP8_CURRENT, BLOCK_M=128, WARPS1=16),
    "bm128 w16 d-w16": R(FP8_CURRENT, BLOCK_M=128, WARPS1=16, WARPS2=16),
}


def case(tokens, gen):
    x = (torch.randn(tokens, H, generator=gen, device=DEVICE) * 0.5).to(torch.bfloat16)
    scores = torch.rand(tokens, E, generator=gen, device=DEVICE)
    weights, index = scores.topk(TOP_K, dim=-1)
    return x, index, weights / weights.sum(-1, keepdim=True)


def expert_weights(gen):
    """Random bf16 expert weights of 26B-A4B's shapes: w_gate_up [E, 2I, H], w_down [E, H, I]."""
    w_gate_up = (torch.randn(E, 2 * I, H, generator=gen, device=DEVICE) * 0.02).to(torch.bfloat16)
    return w_gate_up, (torch.randn(E, H, I, generator=gen, device=DEVICE) * 0.02).to(torch.bfloat16)


def main():
    fp8 = "--fp8" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--fp8"]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w_gate_up, w_down = expert_weights(gen)
    if fp8:
        gate_up_q, down_q = quantize_stacked(w_gate_up, 2), quantize_blocks(w_down)
        candidates, current = FP8_CANDIDATES, FP8_CURRENT

        def moe(x, index, weights, cfg):
            return fp8_fused_moe(x, index, weights, *gate_up_q, *down_q, config=cfg, activation=ACTIVATION)
    else:
        candidates, current = CANDIDATES, CURRENT

        def moe(x, index, weights, cfg):
            return fused_moe(x, index, weights, w_gate_up, w_down, config=cfg, activation=ACTIVATION)
    batch = case(max(TOKENS), gen)
    x, index, weights = (t[:CANVAS] for t in batch)
    alone = moe(x, index, weights, current)
    do_bench(lambda: moe(x, index, weights, current), warmup=300, rep=1000)  # clocks up before the first timing
    results = {}
    for name, cfg in candidates.items():
        row = {}
        for tokens in TOKENS:
            x, index, weights = (t[:tokens] for t in batch)

            def run(cfg=cfg, x=x, index=index, weights=weights):
                return moe(x, index, weights, cfg)
            try:
                out = run()
                row[f"same_{tokens}"] = torch.equal(out[:CANVAS], alone)
                row[f"ms_{tokens}"] = do_bench(run, warmup=10, rep=50, return_mode="median")
            except Exception as err:  # noqa: BLE001 - e.g. out of shared memory
                row[f"ms_{tokens}"], row[f"same_{tokens}"] = float("inf"), None
                print(f"{name} at {tokens}: {type(err).__name__}: {str(err)[:120]}")
        results[name] = row
    flops = {t: 2 * t * TOP_K * (2 * I * H + H * I) for t in TOKENS}
    print(f"\n{'config':>18} " + " ".join(f"{f'ms@{t}':>9} {'bits':>5}" for t in TOKENS))
    for name, row in results.items():
        print(f"{name:>18} " + " ".join(f"{row[f'ms_{t}']:>9.3f} {str(row[f'same_{t}']):>5}" for t in TOKENS))
    print("bits: the first canvas's rows equal that canvas alone through the current config")
    print("floors, ms a layer: " + ", ".join(
        f"{t} tokens {flops[t] / 989e12 * 1e3:.3f} (FLOPs at 989 TFLOP/s)" for t in TOKENS)
        + f"; weights {(3 * E * I * H * (1 if fp8 else 2)) / 4.8e12 * 1e3:.3f} (bytes at 4.8 TB/s)")
    if args:
        json.dump({k: {**v, "config": dataclasses.asdict(candidates[k])} for k, v in results.items()},
                  open(args[0], "w"), indent=1)


if __name__ == "__main__":
    main()
