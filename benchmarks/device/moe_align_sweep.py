"""MoE align at the slot counts a decode forward forms, us a call (20 calls captured in one CUDA graph, replayed):
one program at 4 / 8 / 16 warps and the three-launch chunked path at chunks of 64..512, each checked row for row
against the default. Cases: LLaDA2.0-mini fp8 (8 routed + the shared expert's slot, 257 experts, BLOCK_M 64) and
bf16 (256 experts, BLOCK_M 16) at batch 1 / 64 (32 / 2048 tokens), Diffusion-Gemma 26B-A4B (128 experts, top-8)
at a 256-token canvas and 16 of them. python3 benchmarks/device/moe_align_sweep.py"""
import torch
from fluxlab.bench.moe_tune import graph_ms
from fluxlab.kernels.moe_align import moe_align

dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)


def us(fn, reps=20):
    return 1e3 * graph_ms(lambda: [fn() for _ in range(reps)]) / reps


def ids(tokens, routed, k, shared):
    idx = torch.rand(tokens, routed, device=dev, generator=gen).topk(k, dim=1).indices.int()
    if shared:
        idx = torch.cat([idx, torch.full((tokens, 1), routed, dtype=torch.int32, device=dev)], 1)
    return idx.contiguous()


cases = [("llada fp8 b1", 32, 256, 8, True, 64), ("llada fp8 b64", 2048, 256, 8, True, 64),
         ("llada bf16 b1", 32, 256, 8, False, 16), ("llada bf16 b64", 2048, 256, 8, False, 16),
         ("dg b1 bm16", 256, 128, 8, False, 16), ("dg b1 bm64", 256, 128, 8, False, 64),
         ("dg b16 bm64", 4096, 128, 8, False, 64)]
variants = [("default", {})] + [(f"one w{w}", {"warps": w, "chunk": "one"}) for w in (4, 8, 16)] + \
           [(f"chunk {c}", {"chunk": c}) for c in (64, 128, 256, 512)]
print(f"{'case':>16} {'slots':>6} " + " ".join(f"{v:>10}" for v, _ in variants))
for name, tokens, routed, k, shared, bm in cases:
    idx = ids(tokens, routed, k, shared)
    e = routed + int(shared)
    n = idx.numel()
    ref = moe_align(idx, e, bm)
    used = int(ref[2])
    cells = []
    for _, kw in variants:
        kw = dict(kw)
        if kw.get("chunk") == "one":
            if n > 4096:
                cells.append("-")
                continue
            kw["chunk"] = max(16, 1 << (n - 1).bit_length())
        elif "chunk" in kw and kw["chunk"] >= n:
            cells.append("-")
            continue
        got = moe_align(idx, e, bm, **kw)
        same = torch.equal(got[0][:used], ref[0][:used]) and torch.equal(got[1][:used // bm], ref[1][:used // bm]) \
            and int(got[2]) == used
        cells.append(f"{us(lambda: moe_align(idx, e, bm, **kw)):.2f}" + ("" if same else "!"))
    print(f"{name:>16} {n:>6} " + " ".join(f"{c:>10}" for c in cells), flush=True)
print("(us a call; '!' = rows differ from the default)")
