"""SDAR decode-forward timing against its floor (GPU): random bf16 weights of a preset, one decode forward of
`batch` rows of one block each against `context` cached tokens per row, eager and as a CUDA graph.

    python -m fluxlab.bench.sdar_forward [--preset sdar_8b] [--batch-sizes 1,16,64] [--block 4] [--context 512]

The forward is SDARModel's own (fused QKV, the fused QK-norm + RoPE kernel, SwiGLU, the head over the block's
rows); attention is torch SDPA of each row's block queries over a preallocated K/V cache plus the block (the
memory a paged kernel reads; fluxlab's paged backends are not in this measurement). The floor beside each
number is the larger of (bytes read: the weights the forward touches + the rows' cached K/V) / HBM bandwidth and
FLOPs / the bf16 dense rate, at the H200's datasheet 4.8 TB/s and ~990 TFLOP/s (--hbm-tbs, --tflops).
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


def floor(config, batch: int, block: int, context: int, hbm: float, flops_rate: float) -> dict:
    c = config
    h, d = c.hidden_size, c.head_dim
    attn = h * (c.num_attention_heads + 2 * c.num_key_value_heads) * d + c.num_attention_heads * d * h
    tokens = batch * block
    if c.num_experts:
        moe = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
        expert = 3 * h * c.moe_intermediate_size
        hit = c.num_experts * (1 - (1 - c.num_experts_per_tok / c.num_experts) ** tokens)
        read_mlp = moe * (hit * expert + h * c.num_experts) + (c.num_hidden_layers - moe) * 3 * h * c.intermediate_size
        active_mlp = moe * c.num_experts_per_tok * expert + (c.num_hidden_layers - moe) * 3 * h * c.intermediate_size
    else:
        read_mlp = active_mlp = c.num_hidden_layers * 3 * h * c.intermediate_size
    head = c.vocab_size * h
    weight_bytes = 2 * (c.num_hidden_layers * attn + read_mlp + head)
    kv_bytes = 2 * batch * context * c.num_hidden_layers * 2 * c.num_key_value_heads * d
    flops = (2 * (c.num_hidden_layers * attn + active_mlp + head) * tokens
             + 4 * tokens * (context + block) * c.num_attention_heads * d * c.num_hidden_layers)
    memory_ms, compute_ms = 1e3 * (weight_bytes + kv_bytes) / hbm, 1e3 * flops / flops_rate
    return {"floor_ms": max(memory_ms, compute_ms), "memory_ms": memory_ms, "compute_ms": compute_ms,
            "weight_gb": weight_bytes / 1e9, "kv_gb": kv_bytes / 1e9, "tflop": flops / 1e12}


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
    ap.add_argument("--hbm-tbs", type=float, default=4.8)
    ap.add_argument("--tflops", type=float, default=990.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    model, config = build_random_model(preset_config(args.preset), dtype, device, seed=0)
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        attn = CachedBlockAttention(model, batch, args.block, args.context, device, dtype)
        tokens = batch * args.block
        ids = torch.randint(0, config.vocab_size, (tokens,), device=device)
        pos = (args.context + torch.arange(args.block, device=device)).repeat(batch)

        def forward():
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
        f = floor(config, batch, args.block, args.context, args.hbm_tbs * 1e12, args.tflops * 1e12)
        rows.append({"batch": batch, "eager_ms": eager, "graph_ms": graphed, **f})
        del attn, graph
        torch.cuda.empty_cache()
    result = {"preset": args.preset, "block": args.block, "context": args.context, "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "rows": rows}
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "sdar_forward.json")
    out.write_text(json.dumps(result, indent=2))
    print(f"{args.preset} block {args.block}, {args.context} cached tokens a row, {result['gpu']}")
    print(f"{'batch':>5} {'eager ms':>9} {'graph ms':>9} {'floor ms':>9} {'memory':>7} {'compute':>8} {'graph/floor':>11}")
    for r in rows:
        print(f"{r['batch']:>5} {r['eager_ms']:>9.3f} {r['graph_ms']:>9.3f} {r['floor_ms']:>9.3f} {r['memory_ms']:>7.3f} "
              f"{r['compute_ms']:>8.3f} {r['graph_ms'] / r['floor_ms']:>11.2f}")


if __name__ == "__main__":
    main()
