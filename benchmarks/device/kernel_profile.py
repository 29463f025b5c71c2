"""GPU kernel time per steady step of LLaDA2.0-mini shapes (random bf16, block 32, steps 8), by step kind
(decode / commit) and kernel group, from torch.profiler's kernel records (CUDA-graph replays included).
It runs the synchronous loop (scheduler.async_scheduling=false) so each step's kernels lie inside its
window. Run from the repository root on a GPU: python3 benchmarks/device/kernel_profile.py BS [backend [top [quantization]]]
(quantization: none | fp8, model.quantization: e4m3 projections and experts quantized at load)."""
import collections, sys, time
import torch
from torch.profiler import ProfilerActivity, profile, record_function
from fluxlab.config import compose, validate_config
from fluxlab.engine.llm_engine import LLMEngine
from fluxlab.engine.loading import load_tokenizer
from fluxlab.engine.request import SamplingParams
from fluxlab.bench.roofline import forward_kind, gsm8k_prompts

bs = int(sys.argv[1]); backend = sys.argv[2] if len(sys.argv) > 2 else "triton"
TOP = int(sys.argv[3]) if len(sys.argv) > 3 else 14  # kernels listed by name
quantization = sys.argv[4] if len(sys.argv) > 4 else "none"
cfg = compose("generate", ["model=llada2_mini", "model.load_format=random", "engine.device=cuda", "engine.dtype=bfloat16",
                           "decoding.block_length=32", "decoding.steps=8", f"attention={backend}", "scheduler=paged",
                           "attention.use_decode_cuda_graph=true", f"scheduler.max_num_seqs={bs}",
                           f"scheduler.max_scheduled_tokens={bs * 64}", "model.max_model_len=1024",
                           "scheduler.enable_prefix_cache=false", "scheduler.async_scheduling=false",
                           f"model.quantization={quantization}"])
validate_config(cfg)
eng = LLMEngine(cfg)
for p in gsm8k_prompts(load_tokenizer(None), bs):
    eng.add_request(p, SamplingParams(max_new_tokens=512, steps=8, ignore_eos=True))
for _ in range(30):
    eng.step()
torch.cuda.synchronize()

def kind():
    return forward_kind(eng.scheduler.running, len(eng.scheduler.waiting), bs)

kinds = []
wall = collections.defaultdict(list)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for i in range(24):
        k = kind(); kinds.append(k)
        t0 = time.perf_counter()
        with record_function(f"STEP{i}"):
            eng.step(); torch.cuda.synchronize()
        wall[k].append(1e3 * (time.perf_counter() - t0))
ev = prof.profiler.kineto_results.events()
steps = {}
kernels = []
for e in ev:
    n = e.name()
    if n.startswith("STEP"):
        steps[int(n[4:])] = (e.start_ns(), e.start_ns() + e.duration_ns())
    elif e.device_type() == torch.autograd.DeviceType.CUDA:  # kernels and device copies, not runtime calls
        kernels.append((e.start_ns(), e.duration_ns(), n))

def group(n):
    for key, g in (("_fp8_gate_up_kernel", "fp8 moe gate-up"), ("_fp8_down_kernel", "fp8 moe down"),
                   ("_fp8_gemm_kernel", "fp8 gemm"), ("_quantize_act_kernel", "fp8 quantize"),
                   ("_gate_up_kernel", "moe gate-up"), ("_down_kernel", "moe down"), ("align", "moe align"),
                   ("_count_kernel", "moe align"), ("_chunk", "moe align"), ("_block_attention", "attention"),
                   ("_stats_kernel", "vocab stats"), ("_route_kernel", "router topk"), ("_qk_norm_rope", "qk-norm rope"),
                   ("rms_norm", "rms norm"), ("_combine_kernel", "moe combine"), ("_silu_mul", "silu*up"), ("Memcpy", "memcpy"), ("nvjet", "gemm"), ("gemm", "gemm"), ("Kernel2", "gemm"),
                   ("sm90", "gemm"), ("cutlass", "gemm"), ("reduce", "reduce"), ("elementwise", "elementwise"),
                   ("CatArray", "cat/copy"), ("index", "index/gather"), ("gather", "index/gather"),
                   ("sort", "sort/topk"), ("topk", "sort/topk")):
        if key in n:
            return g
    return "other"

per = {k: collections.defaultdict(float) for k in ("decode", "commit", "other")}
names = {k: collections.defaultdict(float) for k in ("decode", "commit", "other")}
cnt = collections.Counter()
launches, busy_gaps = collections.defaultdict(int), collections.defaultdict(float)
for i, (a, b) in steps.items():
    k = kinds[i]; cnt[k] += 1
    inside = sorted((s, d, n) for s, d, n in kernels if a <= s <= b)
    launches[k] += len(inside)
    # idle time between consecutive kernels, counting only gaps under 20 us (the graph's launch gaps,
    # not the host's waits between eager parts)
    busy_gaps[k] += sum(g for g in (s2 - (s1 + d1) for (s1, d1, _), (s2, _, _) in zip(inside, inside[1:]))
                        if 0 < g < 20_000) / 1e3
    for s, d, n in inside:
        per[k][group(n)] += d / 1e3; names[k][n[:90]] += d / 1e3
for k in ("decode", "commit"):
    if not cnt[k]:
        continue
    c = cnt[k]; tot = sum(per[k].values()) / c
    print(f"== bs={bs} {backend} {k}: {c} steps, wall median {sorted(wall[k])[len(wall[k])//2]:.2f} ms, "
          f"GPU kernel sum {tot / 1e3:.2f} ms/step, {launches[k] / c:.0f} kernels/step, "
          f"gaps under 20 us {busy_gaps[k] / c / 1e3:.3f} ms/step")
    for g, us in sorted(per[k].items(), key=lambda t: -t[1]):
        print(f"   {g:<14} {us / c / 1e3:7.3f} ms  {us / c / tot:5.1%}")
    for n, us in sorted(names[k].items(), key=lambda t: -t[1])[:TOP]:
        print(f"      {us / c:8.1f} us  {n}")
