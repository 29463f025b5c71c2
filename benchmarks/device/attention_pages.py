"""us per call of kernels/block_attention.py at LLaDA2.0-mini's attention shapes (16 query heads, 4 KV
heads of 128, blocks of 32), 20 calls in one CUDA graph, for each pages_per_step; the tree on PYTHONPATH
decides (one without pages_per_step times its one kernel). Run on the device:
python3 benchmarks/device/attention_pages.py LABEL
"""
import inspect
import sys

import torch

from fluxlab.bench.moe_tune import graph_ms
from fluxlab.kernels.block_attention import block_attention

LABEL = sys.argv[1] if len(sys.argv) > 1 else "new"
HQ, HKV, D, BL = 16, 4, 128, 32
takes_pages = "pages_per_step" in inspect.signature(block_attention).parameters


def graph_us(fn, calls=20, reps=10):
    """us per call: `calls` calls captured in one CUDA graph, the graph replayed `reps` times."""
    return 1e3 * graph_ms(lambda: [fn() for _ in range(calls)], reps) / calls


def main():
    torch.manual_seed(0)
    print(f"{LABEL}: batch | context pages | pages/step | us | max |diff| to 1 page/step")
    for batch, pages in ((1, 9), (1, 32), (16, 9), (64, 9), (64, 16)):
        total = batch * pages
        k = torch.randn(total + 1, BL, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(batch * BL, HQ, D, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(total, device="cuda", dtype=torch.int32).view(batch, pages)
        table = torch.cat([table, torch.zeros(batch, 32 - pages, dtype=torch.int32, device="cuda")], 1)
        used = torch.full((batch,), pages * BL, dtype=torch.int32, device="cuda")
        base = block_attention(q, k, v, table, used, D ** -0.5).float()
        for n in ((1, 2, 4) if takes_pages else (None,)):
            kw = {} if n is None else {"pages_per_step": n}
            us = graph_us(lambda: block_attention(q, k, v, table, used, D ** -0.5, **kw))
            diff = (block_attention(q, k, v, table, used, D ** -0.5, **kw).float() - base).abs().max().item()
            print(f"{LABEL}: {batch} | {pages} | {n or 'fixed'} | {us:.2f} | {diff:.2e}")


if __name__ == "__main__":
    main()
