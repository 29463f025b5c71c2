"""Per-call GPU time (us) of the small kernels of a LLaDA2.0-mini MoE layer at 2048 / 4096 tokens (a batch-64
decode / commit forward), each captured 20 times in one CUDA graph and replayed: router top-k (per warps),
MoE align (scan, chunked per chunk size), silu * up, QK-norm + RoPE with the KV write, the shared
expert's and router's GEMMs apart and stacked, and the greedy vocabulary statistics. Run from a tree's root
(this one or a baseline's; what the tree lacks is skipped): python3 benchmarks/device/micro.py LABEL"""
import importlib.util, sys
import torch
import torch.nn.functional as F
import fluxlab.kernels.fused_norm as fn
from fluxlab.bench.moe_tune import graph_ms
from fluxlab.kernels import moe_align as ma

try:  # kernels/route_topk.py from session 10 on; fused_norm.py before
    import fluxlab.kernels.route_topk as rt
except ImportError:
    rt = fn

label = sys.argv[1] if len(sys.argv) > 1 else "tree"
dev = torch.device("cuda")


def us(fn_, reps=20, replays=30):
    """us per call: reps calls captured in one CUDA graph, the graph replayed `replays` times."""
    return 1e3 * graph_ms(lambda: [fn_() for _ in range(reps)], replays) / reps


rows = []
gen = torch.Generator(device=dev).manual_seed(0)
for T in (2048, 4096):
    logits = torch.randn(T, 256, device=dev, generator=gen)
    bias = torch.randn(256, device=dev, generator=gen) * 0.05
    call = lambda: rt.route_topk_from_logits(logits, bias, 8, 8, 4, 2.5)
    if hasattr(rt, "ROUTE_WARPS"):
        default = rt.ROUTE_WARPS
        for w in (1, 2, 4, 8):
            rt.ROUTE_WARPS = w
            rows.append((f"route T={T} warps={w}", us(call)))
        rt.ROUTE_WARPS = default
    else:
        rows.append((f"route T={T}", us(call)))
    idx, _ = rt.route_topk_from_logits(logits, bias, 8, 8, 4, 2.5)
    for bm in (16, 128):  # 128: the tuned config's BLOCK_M at 2048 and 4096 tokens
        ref = ma.moe_align_scan(idx, 256, bm)
        rows.append((f"align scan T={T} bm={bm}", us(lambda: ma.moe_align_scan(idx, 256, bm))))
        for ch in (256, 512, 1024):
            got = ma.moe_align(idx, 256, bm, chunk=ch)
            n = int(ref[2])
            ok = torch.equal(got[0][:n], ref[0][:n]) and torch.equal(got[1][:n // bm], ref[1][:n // bm])
            rows.append((f"align chunk={ch} T={T} bm={bm}{'' if ok else ' MISMATCH'}",
                         us(lambda: ma.moe_align(idx, 256, bm, chunk=ch))))
    gu = torch.randn(T, 1024, device=dev, generator=gen).bfloat16()
    g, u = gu[:, :512], gu[:, 512:]
    g2, u2 = g.contiguous(), u.contiguous()
    rows.append((f"silu*mul torch T={T}", us(lambda: F.silu(g2) * u2)))
    if importlib.util.find_spec("fluxlab.kernels.swiglu"):
        from fluxlab.kernels.swiglu import silu_mul
        assert torch.equal(silu_mul(g2, u2), F.silu(g2) * u2)
        rows.append((f"silu_mul T={T}", us(lambda: silu_mul(g2, u2))))
    # QK-norm + RoPE (+ the KV write) of 16 q / 4 kv heads of 128, rotary 64, into a cache of 4096 pages of 32
    qkv = torch.randn(T, 24 * 128, device=dev, generator=gen).bfloat16()
    cos = torch.randn(T, 64, device=dev, generator=gen).bfloat16()
    sin = torch.randn(T, 64, device=dev, generator=gen).bfloat16()
    w = torch.ones(128, device=dev, dtype=torch.bfloat16)
    kc = torch.zeros(4096 * 32, 4, 128, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(4096, device=dev)[:T // 32].repeat_interleave(32) * 32 + torch.arange(32, device=dev).repeat(T // 32)

    def separate():
        q, k, v = fn.qk_norm_rope(qkv, None, w, w, 1e-6, cos, sin, 16, 4, 128, 64)
        kc[slots] = k
        vc[slots] = v
    rows.append((f"qk-norm+rope + index_put T={T}", us(separate)))
    if hasattr(fn, "qk_norm_rope_to_cache"):
        default = getattr(fn, "QK_WARPS", None)
        for warps in ((2, 4, 8) if default else (None,)):
            if warps:
                fn.QK_WARPS = warps
            rows.append((f"qk-norm+rope to cache T={T} warps={warps}",
                         us(lambda: fn.qk_norm_rope_to_cache(qkv, None, w, w, 1e-6, cos, sin, 16, 4, 128, 64, kc, vc,
                                                             slots))))
        if default:
            fn.QK_WARPS = default
    # the MoE combine: 8 slot rows + the shared expert and the residual per token
    import fluxlab.kernels.fused_moe as fm
    slot_out = torch.randn(T * 8, 2048, device=dev, generator=gen).bfloat16()
    adds = tuple(torch.randn(T, 2048, device=dev, generator=gen).bfloat16() for _ in range(2))
    default = (fm.COMBINE_BLOCK, fm.COMBINE_WARPS) if hasattr(fm, "COMBINE_BLOCK") else None
    for cfg in (((1024, 4), (2048, 8), (2048, 4), (512, 4), (1024, 8)) if default else (None,)):
        if cfg:
            fm.COMBINE_BLOCK, fm.COMBINE_WARPS = cfg
        rows.append((f"combine T={T} block,warps={cfg}", us(lambda: fm.combine_slots(slot_out, 8, adds))))
    if default:
        fm.COMBINE_BLOCK, fm.COMBINE_WARPS = default
    # the shared expert's gate and up GEMMs and the router's, apart and as one stacked GEMM with an fp32 output
    x = torch.randn(T, 2048, device=dev, generator=gen).bfloat16()
    wg, wu = (torch.randn(512, 2048, device=dev, generator=gen).bfloat16() for _ in range(2))
    wr = torch.randn(256, 2048, device=dev, generator=gen).bfloat16()
    ws = torch.cat([wg, wu, wr])
    rows.append((f"gemms gate, up, router T={T}",
                 us(lambda: (x @ wg.t(), x @ wu.t(), torch.mm(x, wr.t(), out_dtype=torch.float32)))))
    rows.append((f"gemm stacked fp32-out T={T}", us(lambda: torch.mm(x, ws.t(), out_dtype=torch.float32))))
from fluxlab.kernels.vocab_stats import greedy_stats
for n in (1024, 2048):
    logits = torch.randn(n, 157184, device=dev, generator=gen).bfloat16()
    rows.append((f"greedy stats {n} x 157184", us(lambda: greedy_stats(logits), reps=5, replays=10)))
print(f"== micro {label}")
for name, t in rows:
    print(f"   {name:<40} {t:8.2f} us")
