"""Per-stage host time of steady engine steps on the GPU, no profiler: wall-clock wrappers around each stage
(docs/benchmarks.md "Host time"; run from the repository root: python3 benchmarks/device/host_stages.py BS POLICY [backend])."""
import sys, time, statistics, collections, functools
import torch
from fluxlab.config import compose, validate_config
from fluxlab.engine.llm_engine import LLMEngine
from fluxlab.engine.loading import load_tokenizer
from fluxlab.engine.request import SamplingParams
from fluxlab.bench.roofline import gsm8k_prompts
from fluxlab.engine import scheduler as sched_mod, model_runner as mr_mod, graph_runner as gr_mod

bs = int(sys.argv[1]); policy = sys.argv[2]; backend = sys.argv[3] if len(sys.argv) > 3 else "flashinfer"
cfg = compose("generate", ["model=llada2_mini", "model.load_format=random", "engine.device=cuda", "engine.dtype=bfloat16",
                           "decoding.block_length=32", "decoding.steps=8", f"attention={backend}", f"scheduler={policy}",
                           "attention.use_decode_cuda_graph=true", f"scheduler.max_num_seqs={bs}",
                           f"scheduler.max_scheduled_tokens={bs * 64}", "model.max_model_len=1024", "scheduler.enable_prefix_cache=false"])
validate_config(cfg)
eng = LLMEngine(cfg)
acc = collections.defaultdict(float)
cnt = collections.Counter()
calls = collections.defaultdict(list)  # per call, for medians (means carry the block commits)
def wrap(obj, name, label):
    fn = getattr(obj, name)
    @functools.wraps(fn)
    def w(*a, **k):
        t = time.perf_counter(); r = fn(*a, **k); d = time.perf_counter() - t
        acc[label] += d; cnt[label] += 1; calls[label].append(d); return r
    setattr(obj, name, w)
wrap(sched_mod.Scheduler, "schedule", "schedule")
wrap(sched_mod.Scheduler, "postprocess", "postprocess")
if hasattr(mr_mod.ModelRunner, "prepare_decode"):  # session 7: the decode half runs after the launch
    wrap(mr_mod.ModelRunner, "prepare_forward", "prepare_forward")
    wrap(mr_mod.ModelRunner, "prepare_decode", "prepare_decode (after the launch)")
else:
    wrap(mr_mod.ModelRunner, "prepare", "prepare")
if hasattr(mr_mod.ModelRunner, "_upload"):  # before the staging buffer (session 6): one upload before the launch
    wrap(mr_mod.ModelRunner, "_upload", "upload")
else:
    from fluxlab.engine import staging as staging_mod
    wrap(staging_mod.HostStaging, "upload", "upload (after the launch on graphs)")
    wrap(staging_mod.HostStaging, "begin", "staging.begin")
if not hasattr(mr_mod.ModelRunner, "_forward"):
    wrap(mr_mod.ModelRunner, "execute", "execute (to the head)")
wrap(gr_mod.CapturedForward, "load", "graph.load(+plan)")
wrap(gr_mod.CapturedForward, "replay", "replay")
wrap(mr_mod.ModelRunner, "_decode", "decode(+wait)")
try:
    import flashinfer
    wrap(flashinfer.BatchPrefillWithPagedKVCacheWrapper, "plan", "flashinfer.plan (real)")
except ImportError:
    pass
prompts = gsm8k_prompts(load_tokenizer(None), bs)
lengths = [96, 160, 224, 288, 352]
added = 0
def top_up():
    global added
    while len(eng.scheduler.running) + len(eng.scheduler.waiting) < bs:
        eng.add_request(prompts[added % bs], SamplingParams(max_new_tokens=lengths[added % 5] if policy == "dynamic" else 1024 - 400, steps=8, ignore_eos=True))
        added += 1
top_up()
for _ in range(40):
    eng.step(); top_up()
torch.cuda.synchronize()
acc.clear(); cnt.clear(); calls.clear()
runner = eng.runner
hosts = []
N = 120
for _ in range(N):
    t0 = time.perf_counter()
    eng.step()
    t1 = time.perf_counter()
    top_up()
    hosts.append(1e3 * ((runner.launched_at - t0) + (t1 - runner.results_at)))
print(f"bs={bs} {policy} {backend}: host ms/step median {statistics.median(hosts):.3f} mean {statistics.mean(hosts):.3f}; "
      "per stage (ms/step mean, median call ms, calls):")
for k in acc:
    print(f"   {k:36s} {1e3 * acc[k] / N:7.3f}  {1e3 * statistics.median(calls[k]):7.3f}  ({cnt[k]})")
