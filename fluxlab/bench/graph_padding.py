"""How much a CUDA-graph ladder pads the forwards a policy makes, on the CPU (forward stubbed).

    python -m fluxlab.bench.graph_padding [--policies paged,dynamic] [--concurrency 16,64] [--prompts 128]

Replays the served setting of docs/benchmarks.md §7 in a closed loop (C requests in flight, a new
one when one finishes; block 32, steps 8, 256 tokens, the tiny model with the host_step stubs and
confidences that never pass the threshold, so every step accepts exactly its scheduled k as random
weights do) and records each forward's segments (query blocks) and the engine's host time per step
(LLMEngine.total_host_seconds: before the forward's launch and after its results). For the engine's capture ladder
(`graph_segment_sizes` of that config), the multiples-of-8 one it had before and two finer ones it reports the mean padded size of the
steady forwards: padding segments run the whole model, so they cost what real ones cost.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from fluxlab.engine.request import SamplingParams

CAPTURE_BS = (1, 2, 4, 8, 16, 32, 64)


def record_segments(policy: str, concurrency: int, num_prompts: int) -> tuple[list[list[int]], list[int], list[float]]:
    from fluxlab.bench.host_step import NoAttention, StubModel
    from fluxlab.bench.roofline import gsm8k_prompts
    from fluxlab.engine.graph_runner import graph_segment_sizes
    from fluxlab.llm import LLM

    llm = LLM(overrides=["model=tiny_llada2", "engine.device=cpu", "engine.dtype=float32",
                         "decoding.block_length=32", "decoding.steps=8", f"scheduler={policy}",
                         "scheduler.max_num_seqs=64", "scheduler.max_scheduled_tokens=4096", "model.max_model_len=1024"])
    engine = llm.engine
    ladder_cfg = engine.cfg.copy()
    ladder_cfg.attention.use_decode_cuda_graph = True
    ladder_cfg.attention.cuda_graph_capture_bs = list(CAPTURE_BS)
    ladder = graph_segment_sizes(ladder_cfg)
    runner = engine.runner
    runner.model = StubModel(engine.model, token_id=1)
    runner.model.conf *= 0.5  # below decoding.threshold=0.9: each step accepts exactly k
    runner.backend, runner.attention = "stub", NoAttention()
    forwards: list[list[int]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule(**kwargs):
        batch = schedule(**kwargs)
        forwards.append(batch.num_blocks.tolist())
        return batch

    engine.scheduler.schedule = recording_schedule
    prompts = gsm8k_prompts(engine.tokenizer, num_prompts)
    params = SamplingParams(max_new_tokens=256, ignore_eos=True)
    added, host_s = 0, []
    while added < num_prompts or engine.has_unfinished():
        while added < num_prompts and engine.num_running + engine.num_waiting < concurrency:
            engine.add_request(prompts[added], params)
            added += 1
        before = engine.total_host_seconds
        engine.step()
        host_s.append(engine.total_host_seconds - before)
    return forwards, ladder, host_s


def main() -> None:
    from fluxlab.engine.graph_runner import plan_chunks

    ap = argparse.ArgumentParser()
    ap.add_argument("--policies", default="paged,dynamic")
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--prompts", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| policy | C | rows/forward | segments/forward | host ms/step | ladder | graphs | padded segments | padding |")
    print("|---|---|---|---|---|---|---|---|---|")
    for policy in args.policies.split(","):
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            forwards, ladder, host_s = record_segments(policy, concurrency, args.prompts)
            cut = len(forwards) // 10
            steady = forwards[cut:-cut]  # without ramp-up and drain
            host_ms = 1e3 * statistics.mean(host_s[cut:-cut])
            real = statistics.mean(sum(r) for r in steady)
            rows = statistics.mean(len(r) for r in steady)
            base = {n for b in CAPTURE_BS for n in (b, 2 * b)}
            ladders = {"engine's": ladder, "multiples of 8": sorted(base | set(range(8, 129, 8))),
                       "multiples of 2": sorted(base | set(range(2, 129, 2))),
                       "every size to 80": sorted(base | set(range(1, 81)) | set(range(8, 129, 8)))}
            for name, sizes in ladders.items():
                padded = statistics.mean(plan_chunks(r, sizes, "padded")[0][1] for r in steady)
                print(f"| {policy} | {concurrency} | {rows:.2f} | {real:.2f} | {host_ms:.3f} | {name} | {len(sizes)} | {padded:.2f} "
                      f"| +{100 * (padded / real - 1):.0f}% |", flush=True)


if __name__ == "__main__":
    main()
