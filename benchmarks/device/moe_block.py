"""The LLaDA2.0-mini MoE block (router + routed experts + shared expert + add) under CUDA-graph replay, ms per
call at 512-4096 tokens: the block as it is, the shared expert as a 257th expert of the fused kernel (weight 1),
the shared expert on a side stream, the routed part alone, the shared expert alone; plus the largest difference
of each variant's output from the block's. docs/benchmarks.md "Kernels" has the numbers (measured
before the combine pass took the adds). Run on a GPU from the repository root: python3 benchmarks/device/moe_block.py [TOKENS]"""
import sys, torch
from fluxlab.models.llada2.model import LLaDA2MoeConfig, LLaDA2MoeSparseMoeBlock
from fluxlab.engine.layers.moe import StackedExperts
from fluxlab.kernels.fused_moe import fused_moe
from fluxlab.kernels.moe_config import default_config
torch.manual_seed(0)
dev = torch.device("cuda")
c = LLaDA2MoeConfig()
blk = LLaDA2MoeSparseMoeBlock(c, torch.bfloat16, dev)
for p in blk.parameters():
    torch.nn.init.normal_(p, std=0.02)
blk.gate.expert_bias.zero_()
for m in blk.modules():
    if isinstance(m, StackedExperts):
        m.backend = "triton"
se = blk.shared_experts
wgu9 = torch.cat([blk.experts.w_gate_up, torch.cat([se.gate_proj.weight, se.up_proj.weight])[None]])
wd9 = torch.cat([blk.experts.w_down, se.down_proj.weight[None]])
side = torch.cuda.Stream()
def cur(x): return blk(x)
def fused9(x):
    idx, w = blk.gate(x)
    T = x.shape[0]
    idx9 = torch.cat([idx, torch.full((T, 1), c.num_experts, dtype=idx.dtype, device=dev)], 1)
    w9 = torch.cat([w.float(), torch.ones(T, 1, device=dev)], 1)
    cfg = default_config(T, 8, 256, 2048, 512, torch.bfloat16, dev)
    return fused_moe(x, idx9, w9, wgu9, wd9, config=cfg)
def overlap(x):
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sh = se(x)
    idx, w = blk.gate(x)
    y = blk.experts(x, idx, w)
    torch.cuda.current_stream().wait_stream(side)
    return y + sh
def routed_only(x):
    idx, w = blk.gate(x)
    return blk.experts(x, idx, w)
def shared_only(x): return se(x)
def timed(fn, x, iters=50):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(x)
    g.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(iters): g.replay()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / iters, out.clone()
print(f"{'tokens':>6} " + " ".join(f"{n:>12}" for n in ("current", "fused9", "overlap", "routed", "shared")) + "  maxdiff fused9 / overlap")
for T in [int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "512,1024,2048,4096").split(",")]:
    x = torch.randn(T, 2048, device=dev, dtype=torch.bfloat16)
    res = {n: timed(f, x) for n, f in (("current", cur), ("fused9", fused9), ("overlap", overlap),
                                        ("routed", routed_only), ("shared", shared_only))}
    ref = res["current"][1].float()
    d9 = (res["fused9"][1].float() - ref).abs().max().item(); do = (res["overlap"][1].float() - ref).abs().max().item()
    print(f"{T:>6} " + " ".join(f"{res[n][0]:12.4f}" for n in res) + f"  {d9:.2e} / {do:.2e} (|ref| max {ref.abs().max().item():.2e})")
