"""Where a steady step's host time goes on the GPU's host, as gaps between wall-clock stamps (no profiler),
and whether numpy is slower right after the step's device->host wait than in a warm loop.
It times the synchronous loop (scheduler.async_scheduling=false where the key exists: with async scheduling a
repeated step's forward is launched inside the last step). Run from the repository root:
python3 docs/device_host_timeline.py BS POLICY [backend]"""
import collections, functools, statistics, sys, time
import numpy as np
import torch
from fluxlab.config import compose, validate_config
from fluxlab.config.schema import SchedulerConfig
from fluxlab.engine.llm_engine import LLMEngine, load_tokenizer
from fluxlab.engine.request import SamplingParams
from fluxlab.bench.roofline import gsm8k_prompts
from fluxlab.engine import scheduler as sched_mod, model_runner as mr_mod, graph_runner as gr_mod

bs = int(sys.argv[1]); policy = sys.argv[2]; backend = sys.argv[3] if len(sys.argv) > 3 else "triton"
cfg = compose("generate", ["model=llada2_mini", "model.load_format=random", "engine.device=cuda", "engine.dtype=bfloat16",
                           "decoding.block_length=32", "decoding.steps=8", f"attention={backend}", f"scheduler={policy}",
                           "attention.use_decode_cuda_graph=true", f"scheduler.max_num_seqs={bs}",
                           f"scheduler.max_scheduled_tokens={bs * 64}", "model.max_model_len=1024",
                           "scheduler.enable_prefix_cache=false"]
              + (["scheduler.async_scheduling=false"] if "async_scheduling" in SchedulerConfig.__dataclass_fields__ else []))
validate_config(cfg)
eng = LLMEngine(cfg)
stamps = {}
def wrap(obj, name, label):
    fn = getattr(obj, name)
    @functools.wraps(fn)
    def w(*a, **k):
        stamps.setdefault(label + "<", time.perf_counter())
        r = fn(*a, **k)
        stamps[label + ">"] = time.perf_counter()
        return r
    setattr(obj, name, w)
wrap(sched_mod.Scheduler, "schedule", "schedule")
wrap(mr_mod.ModelRunner, "prepare_forward", "prepare_forward")
wrap(gr_mod.CapturedForward, "load", "load")
wrap(sched_mod.Scheduler, "postprocess", "postprocess")
wrap(mr_mod.ModelRunner, "_decode", "decode")
wrap(mr_mod.ModelRunner, "run", "run")
prompts = gsm8k_prompts(load_tokenizer(None), bs)
for p in prompts:
    eng.add_request(p, SamplingParams(max_new_tokens=1024 - 400, steps=8, ignore_eos=True))
for _ in range(40):
    eng.step()
torch.cuda.synchronize()
runner = eng.runner
gaps = collections.defaultdict(list)
hosts = []
for _ in range(160):
    stamps.clear()
    t0 = time.perf_counter()
    eng.step()
    t1 = time.perf_counter()
    if "load<" not in stamps or runner.results_at < runner.launched_at:
        continue
    seq = [("t0", t0), ("schedule<", stamps["schedule<"]), ("schedule>", stamps["schedule>"]),
           ("prepare_forward<", stamps["prepare_forward<"]), ("prepare_forward>", stamps["prepare_forward>"]),
           ("load<", stamps["load<"]), ("load>", stamps["load>"]), ("launched", runner.launched_at)]
    after = [("results", runner.results_at), ("decode>", stamps["decode>"]), ("run>", stamps["run>"]),
             ("postprocess<", stamps["postprocess<"]),
             ("postprocess>", stamps["postprocess>"]), ("t1", t1)]
    for part in (seq, after):
        for (a, ta), (b, tb) in zip(part, part[1:]):
            gaps[f"{a} -> {b}"].append(1e3 * (tb - ta))
    hosts.append(1e3 * ((runner.launched_at - t0) + (t1 - runner.results_at)))
print(f"bs={bs} {policy} {backend}: host ms/step median {statistics.median(hosts):.3f} ({len(hosts)} steps)")
for k, v in gaps.items():
    print(f"   {k:40s} median {statistics.median(v):.4f}  mean {statistics.mean(v):.4f}")

# numpy ops of a decode step's postprocess: warm loop vs right after a device->host wait on a 10 ms kernel
S, MB, bl, R = 64, 40, 32, 64
tokens = np.zeros((S, MB * bl), dtype=np.int64); blocks = tokens.reshape(S, MB, bl)
seat = np.random.permutation(S)[:R].astype(np.int64); active = np.random.randint(0, MB, R).astype(np.int64)
counts = np.zeros((S, 4), dtype=np.int64); added = np.ones((R, 4), dtype=np.int64)
dev = torch.zeros(R, bl + 5, dtype=torch.long, device="cuda")
def ops(host):
    t = time.perf_counter()
    ob = host[:, :bl]
    host[:, bl + 2].astype(bool).nonzero()  # (postprocess finds the final rows)
    blocks[seat, active] = ob
    added[:, 2], added[:, 3] = host[:, bl], host[:, bl + 1]
    c = counts.take(seat, axis=0); c += added; counts[seat] = c
    return 1e3 * (time.perf_counter() - t)
host = dev.cpu().numpy()
warm = [ops(host) for _ in range(200)]
after_sync, after_spin = [], []
for _ in range(40):
    torch.cuda._sleep(10_000_000)
    host = dev.cpu().numpy()
    after_sync.append(ops(host))
    torch.cuda._sleep(10_000_000)
    ev = torch.cuda.Event(); ev.record()
    while not ev.query():
        pass
    host = dev.cpu().numpy()
    after_spin.append(ops(host))
print(f"numpy postprocess ops ms: warm loop {statistics.median(warm):.4f}, after a blocking D2H {statistics.median(after_sync):.4f}, "
      f"after a Python spin on an event {statistics.median(after_spin):.4f}")
