"""Host time per engine step, measured as GPU idle time between steps (GPU).

    python -m fluxlab.bench.host_gap [--preset llada2_mini] [--batch-sizes 1,16,64] [--policy paged]

Builds random bf16 weights of a preset with decode CUDA graphs, brings a batch of GSM8K-style
prompts into steady decoding, then traces N steps with the CUDA profiler: the GPU is idle between
its kernels only while the host schedules, prepares and post-processes a step, so
(kernel span - union of kernel intervals) / (N - 1) is the host time each step costs the GPU.
Uses only LLMEngine's public API, so the same script measures an older fluxlab checkout too.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from fluxlab.engine.request import SamplingParams


def busy_union_us(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(span from the first start to the last end, time covered by at least one interval)."""
    intervals.sort()
    busy, cur_start, cur_end = 0.0, None, None
    for start, end in intervals:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        busy += cur_end - cur_start
    return (intervals[-1][1] - intervals[0][0]) if intervals else 0.0, busy


def measure(engine, prompts: list[list[int]], steps: int, traced: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_new_tokens=256, steps=steps, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while engine.scheduler.waiting or any(r.num_cached_blocks < r.active_block for r in engine.scheduler.running):
        engine.step()  # prefill done: every row decodes from here on
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(traced):
            engine.step()
        torch.cuda.synchronize()
    kernels = [(e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    span, busy = busy_union_us(kernels)
    while engine.has_unfinished():
        engine.step()
    return {"steps_traced": traced, "gpu_span_ms": span / 1e3, "gpu_busy_ms": busy / 1e3,
            "host_ms_per_step": (span - busy) / 1e3 / (traced - 1), "busy_ms_per_step": busy / 1e3 / traced}


def main() -> None:
    from fluxlab.bench.roofline import gsm8k_prompts
    from fluxlab.config import compose, validate_config
    from fluxlab.engine.llm_engine import LLMEngine
    from fluxlab.engine.loading import load_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llada2_mini")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--policy", default="paged")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--traced", type=int, default=16)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "host_gap.json"))
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    max_bs = max(sizes)
    cfg = compose("generate", [f"model={args.preset}", "model.load_format=random", "engine.device=cuda",
                               "engine.dtype=bfloat16", f"decoding.block_length={args.block}",
                               f"decoding.steps={args.steps}", "attention=flashinfer", f"scheduler={args.policy}",
                               "attention.use_decode_cuda_graph=true",
                               f"attention.cuda_graph_capture_bs=[{','.join(map(str, sizes))}]",
                               f"scheduler.max_num_seqs={max_bs}",
                               f"scheduler.max_scheduled_tokens={max_bs * args.block * 2}", "model.max_model_len=1024"])
    validate_config(cfg)
    engine = LLMEngine(cfg)
    prompts = gsm8k_prompts(load_tokenizer(None), max_bs)
    measure(engine, prompts[:1], args.steps, 4)  # warm-up
    rows = []
    for bs in sizes:
        row = {"batch": bs, "policy": args.policy, **measure(engine, prompts[:bs], args.steps, args.traced)}
        rows.append(row)
        print(f"host_gap bs={bs:>3} {args.policy}: host {row['host_ms_per_step']:.3f} ms/step, "
              f"GPU busy {row['busy_ms_per_step']:.2f} ms/step", flush=True)
    with open(args.out, "w") as f:
        json.dump({"preset": args.preset, "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
