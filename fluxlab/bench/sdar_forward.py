"""SDAR decode-forward timing against its floor (GPU): random bf16 weights of a preset, one decode forward of
`batch` rows of one block each against `context` cached tokens per row, eager and as a CUDA graph.

    python -m fluxlab.bench.sdar_forward [--preset sdar_8b] [--batch-sizes 1,16,64] [--block 4] [--context 512]

The forward is SDARModel's own (fused QKV, the fused QK-norm + RoPE kernel, SwiGLU, the head over the block's
rows); attention is torch SDPA of each row's block queries over a preallocated K/V cache plus the block (the
memory a paged kernel reads; fluxlab's paged backends are not in this measurement: for the engine's own
forward through them, `python -m fluxlab.bench.roofline --preset sdar_8b --block 4 --steps 4`). Beside each
number: the roofline bench's floors (fluxlab/bench/roofline.py), the larger of bytes / HBM bandwidth and FLOPs /
the bf16 rate, and the serial floor (the stages' floors in sequence), from ceilings measured in the same run
(or --hbm-tbs and --tflops, e.g. the H200's datasheet 4.8 and 990).
Prints a table last; writes JSON to --out (or $OUT/sdar_forward.json).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F


class CachedBlockAttention:
    """Each row's `block` queries attend to its `context` cached keys and its own block (bidirectional)."""

    def __init__(self, model, batch: int, block: int, context: int, device, dtype):
        c = model.config
        self.batch, self.block, self.groups = batch, block, c.num_attention_heads // c.num_key_value_heads
        shape = (c.num_hidden_layers, batch, c.num_key_value_heads, context, c.head_dim)
        self.k_cache = torch.randn(shape, device=device, dtype=dtype)
        self.v_cache = torch.randn(shape, device=device, dtype=dtype)

    def forward(self, layer: int, q, k, v):
        B, bl = self.batch, self.block
        q = q.view(B, bl, *q.shape[1:]).transpose(1, 2)  # [B, Hq, bl, D]
        k = torch.cat([self.k_cache[layer], k.view(B, bl, *k.shape[1:]).transpose(1, 2)], dim=2)
        v = torch.cat([self.v_cache[layer], v.view(B, bl, *v.shape[1:]).transpose(1, 2)], dim=2)
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return o.transpose(1, 2).reshape(B * bl, *o.shape[1:2], o.shape[-1])


def floors(config, batch: int, block: int, context: int, ceilings: dict) -> dict:
    """The roofline bench's two floors for this forward: the larger of bytes/HBM and FLOPs/rate, and
    the serial floor (its stages' floors added up), with every block row through the head as here."""
    from fluxlab.bench.roofline import decode_floor, serial_floor

    f = decode_floor(config, batch, block, context, ceilings)
    serial = serial_floor(config, batch, block, batch * block, context, ceilings)
    return {"floor_ms": f["floor_ms"], "memory_ms": f["memory_ms"], "compute_ms": f["compute_ms"],
            "serial_floor_ms": sum(serial.values()), "serial_stages_ms": serial}


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / iters


def main() -> None:
    from fluxlab.models.sdar.loader import build_random_model
    from fluxlab.models.sdar.presets import preset_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="sdar_8b")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--hbm-tbs", type=float, default=None, help="HBM TB/s for the floors (default: measured now)")
    ap.add_argument("--tflops", type=float, default=None, help="bf16 TFLOP/s for the floors (default: measured now)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    if args.hbm_tbs and args.tflops:
        ceilings = {"hbm_bytes_per_s": args.hbm_tbs * 1e12, "bf16_flops_per_s": args.tflops * 1e12}
    else:
        from fluxlab.bench.roofline import measure_ceilings

        ceilings = measure_ceilings()
    model, config = build_random_model(preset_config(args.preset), dtype, device, seed=0)
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        attn = CachedBlockAttention(model, batch, args.block, args.context, device, dtype)
        tokens = batch * args.block
        ids = torch.randint(0, config.vocab_size, (tokens,), device=device)
        pos = (args.context + torch.arange(args.block, device=device)).repeat(batch)

        def forward(attn=attn):  # bound now: `del attn` below frees this batch's cache before the next
            return model.compute_logits(model(ids, pos, attn), fp32=False)

        with torch.inference_mode():
            eager = time_ms(forward, args.iters)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                forward()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward()
            graphed = time_ms(graph.replay, args.iters)
        f = floors(config, batch, args.block, args.context, ceilings)
        rows.append({"batch": batch, "eager_ms": eager, "graph_ms": graphed, **f})
        del attn, graph
        torch.cuda.empty_cache()
    result = {"ceilings": ceilings, "preset": args.preset, "block": args.block, "context": args.context,
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "sdar_forward.json")
    out.write_text(json.dumps(result, indent=2))
    print(f"{args.preset} block {args.block}, {args.context} cached tokens a row, {result['gpu']}")
    print(f"{'batch':>5} {'eager ms':>9} {'graph ms':>9} {'floor ms':>9} {'serial floor':>12} {'graph/serial':>12}")
    for r in rows:
        print(f"{r['batch']:>5} {r['eager_ms']:>9.3f} {r['graph_ms']:>9.3f} {r['floor_ms']:>9.3f} "
              f"{r['serial_floor_ms']:>12.3f} {r['graph_ms'] / r['serial_floor_ms']:>12.2f}")


if __name__ == "__main__":
    main()
