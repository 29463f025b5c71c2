"""Host time per engine step on the CPU, the forward stubbed (no GPU needed).

    python -m fluxlab.bench.host_step [--batch-sizes 1,16,64] [--policies paged,dynamic] [--steps 96]
                                      [--plan none|flashinfer]

Runs the real engine step (schedule -> runner.run -> postprocess) on the tiny model with the model
body and the logits head replaced by stubs: the body returns a zero hidden state, the greedy head
returns a fixed token with precomputed pseudo-random confidences (so the threshold decoder accepts
its scheduled k per step, as random weights do on the GPU). What remains is the host path the GPU
waits for between graph replays: schedule, prepare, the host half of execute (index math, upload)
up to the launch, and postprocess after the results. `--plan flashinfer` adds the host half of
FlashInfer's plan before the launch (its index tensors, on the host; not the wrapper's own plan
call, which needs the GPU). The decode step (decoder ops on CPU tensors; on the GPU they queue
behind the forward) is reported apart and left out of the host total.
Uses only LLMEngine's public objects, so the same script measures an older fluxlab checkout too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from fluxlab.engine.request import SamplingParams


class StubModel(torch.nn.Module):
    """The model's interface with no compute: zero hidden states, a fixed greedy answer."""

    def __init__(self, model, token_id: int, seed: int = 0):
        super().__init__()
        self.config = model.config
        self.token_id = token_id
        self.conf = torch.rand(1 << 16, generator=torch.Generator().manual_seed(seed))
        self.offset = 0

    def forward(self, input_ids, positions, attn):
        return torch.zeros(input_ids.shape[0], 1)

    def compute_greedy_stats(self, hidden, fp32=True):
        n = hidden.shape[0]
        if self.offset + n > self.conf.shape[0]:
            self.offset = 0
        conf = self.conf[self.offset:self.offset + n]
        self.offset += n
        return torch.full((n,), self.token_id, dtype=torch.long), conf

    def compute_logits(self, hidden, fp32=True):
        raise RuntimeError("host_step runs greedy rows only")


class NoAttention:
    def begin(self, meta) -> None:
        pass


class FlashInferHostPlan:
    """FlashInfer's host-side plan arrays (what plan() hands the wrapper), without the wrapper: the
    part of the GPU path's plan that is fluxlab's Python."""

    def __init__(self, block_length: int):
        self.block_length = block_length
        self.started_at = self.seconds = 0.0  # the last plan's start and duration

    def begin(self, meta) -> None:
        from fluxlab.engine.layers import attention_flashinfer

        self.started_at = time.perf_counter()
        if hasattr(attention_flashinfer, "plan_tensors"):
            attention_flashinfer.plan_tensors(meta.segments, self.block_length, torch.device("cpu"))
        else:  # a checkout from before issue 13d plans from per-row page tables
            qo_indptr, kv_indptr, kv_indices = attention_flashinfer.segments(meta.rows, self.block_length)
            torch.from_numpy(qo_indptr), torch.from_numpy(kv_indptr), torch.from_numpy(kv_indices)
            torch.full((len(qo_indptr) - 1,), self.block_length, dtype=torch.int32)
        self.seconds = time.perf_counter() - self.started_at


def timed(owner, name: str, sink: list[float]):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t0)

    setattr(owner, name, wrapper)


def measure(policy: str, batch: int, steps: int, block: int, decoding_steps: int, plan: str = "none") -> dict:
    from fluxlab.bench.roofline import gsm8k_prompts
    from fluxlab.llm import LLM

    llm = LLM(overrides=["model=tiny_llada2", "engine.device=cpu", "engine.dtype=float32",
                         f"decoding.block_length={block}", f"decoding.steps={decoding_steps}", f"scheduler={policy}",
                         f"scheduler.max_num_seqs={batch}", f"scheduler.max_scheduled_tokens={max(batch, 16) * block * 2}",
                         "model.max_model_len=2048"])
    engine = llm.engine
    runner = engine.runner
    runner.model = StubModel(engine.model, token_id=engine.eos_id + 1 if engine.eos_id + 1 != engine.mask_id else 1)
    runner.backend = "stub"  # no dense sdpa metadata: on the GPU a graph replays instead
    runner.attention = FlashInferHostPlan(block) if plan == "flashinfer" else NoAttention()
    sinks = {"schedule": [], "prepare": [], "prepare_decode": [], "postprocess": []}
    timed(engine.scheduler, "schedule", sinks["schedule"])
    if hasattr(runner, "prepare_decode"):  # since session 7 the decode half runs after the launch
        timed(runner, "prepare_forward", sinks["prepare"])
        timed(runner, "prepare_decode", sinks["prepare_decode"])
    else:
        timed(runner, "prepare", sinks["prepare"])
    timed(engine.scheduler, "postprocess", sinks["postprocess"])
    params = SamplingParams(max_new_tokens=2048 - 256, ignore_eos=True)
    for prompt in gsm8k_prompts(engine.tokenizer, batch):
        engine.add_request(prompt[:200], params)
    while engine.scheduler.waiting or any(r.state.value != "decoding" for r in engine.scheduler.running):
        engine.step()  # prefill done: every row decodes from here on
    for _ in range(4):
        engine.step()
    for sink in sinks.values():
        sink.clear()
    step_s, launch_s, decode_s, after_s = [], [], [], []
    for _ in range(steps):
        if len(engine.scheduler.running) < batch:
            raise RuntimeError("a request finished during the timed steps: raise max_new_tokens")
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        step_s.append(t1 - t0)
        late_plan = 0.0  # a checkout that stamps the launch before the plan: the plan is host time
        if plan == "flashinfer" and runner.attention.started_at >= runner.launched_at:
            late_plan = runner.attention.seconds
        launch_s.append(runner.launched_at - t0 + late_plan)
        decode_s.append(runner.results_at - runner.launched_at - late_plan)
        after_s.append(t1 - runner.results_at)
    engine.shutdown()
    us = lambda values: 1e6 * statistics.mean(values)  # noqa: E731  (mean: block commits are part of the cost)
    row = {"policy": policy, "batch": batch, "steps": steps, "plan": plan,
           "schedule_us": us(sinks["schedule"]),
           "prepare_us": us(sinks["prepare"]) + (us(sinks["prepare_decode"]) if sinks["prepare_decode"] else 0.0),
           "launch_us": us(launch_s), "decode_us": us(decode_s), "postprocess_us": us(sinks["postprocess"]),
           "after_results_us": us(after_s), "step_us": us(step_s)}
    # What the GPU waits for: everything up to the launch, and everything after the results.
    row["host_us"] = row["launch_us"] + row["after_results_us"]
    host = [a + b for a, b in zip(launch_s, after_s)]
    row["host_median_us"] = 1e6 * statistics.median(host)  # a step without block commits
    row["host_max_us"] = 1e6 * max(host)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--policies", default="paged,dynamic")
    ap.add_argument("--steps", type=int, default=200, help="timed steady decode steps per run")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--decoding-steps", type=int, default=8)
    ap.add_argument("--plan", choices=["none", "flashinfer"], default="none",
                    help="flashinfer: the stub attention builds FlashInfer's host plan arrays each forward")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "host_step.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for policy in args.policies.split(","):
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            row = measure(policy, batch, args.steps, args.block, args.decoding_steps, args.plan)
            rows.append(row)
            print(f"host_step {policy} bs={batch}: host {row['host_us']:.0f} us/step", flush=True)
    print("\n| policy | batch | schedule µs | prepare µs | to launch µs | postprocess µs | after results µs "
          "| host µs/step (mean) | median | decode step µs (overlapped on GPU) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['batch']} | {r['schedule_us']:.0f} | {r['prepare_us']:.0f} | {r['launch_us']:.0f} "
              f"| {r['postprocess_us']:.0f} | {r['after_results_us']:.0f} | {r['host_us']:.0f} | {r['host_median_us']:.0f} "
              f"| {r['decode_us']:.0f} |")
    with open(args.out, "w") as f:
        json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
