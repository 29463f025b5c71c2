"""Per-step control overhead of tensor parallelism on CPU gloo (tiny model, fp32, greedy).

    python -m fluxlab.bench.tp_overhead [--batch-sizes 1,16,64] [--layout tp2] [--out tp_overhead.json]

For each batch size B: B prompts decode to the end under tp1 and under the layout; the table gives
the median engine step time of each, their difference (what TP costs the host path here: the CPU
shards also halve the compute, so this is a lower bound of the control cost), and the bytes that
cross ranks per step on the control path, counted at rank 0: the step channel's bytes to all
workers (shared-memory differences + doorbells, `ParallelEngine.step_bytes_sent`; timed around the
runner's on_step), and the vocabulary path (an all-gather of fp32 logit shards is received
by every rank: tp*(tp-1)*shard; a gather to rank 0 only (tp-1)*shard). The forward's own all-reduces
are timed (allred ms), not counted as control bytes.
Rank 0 and each worker use one thread (FLUXLAB_WORKER_THREADS=1), so the ranks do not fight for cores.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from fluxlab.engine.request import SamplingParams

BL = 16


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@contextmanager
def counting_collectives(tp_size: int, counts: dict):
    """Wrap rank 0's control-path collectives to add their cross-rank bytes and time to counts."""
    originals = {name: getattr(dist, name) for name in ("all_gather", "gather", "all_reduce")}

    def timed(name, nbytes_of):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            out = originals[name](*args, **kwargs)
            key = "model_all_reduce" if name == "all_reduce" else "vocab"
            counts[key + "_bytes"] += nbytes_of(*args, **kwargs)
            counts[key + "_s"] += time.perf_counter() - started
            return out
        return wrapper

    def all_gather_bytes(parts, tensor, *a, **k):
        return tp_size * (tp_size - 1) * tensor_bytes([tensor])

    def gather_bytes(tensor, *a, **k):
        return (tp_size - 1) * tensor_bytes([tensor])

    dist.all_gather = timed("all_gather", all_gather_bytes)
    dist.gather = timed("gather", gather_bytes)
    dist.all_reduce = timed("all_reduce", lambda tensor, *a, **k: 0)  # timed only: the forward's own traffic
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def measure(layout: str, batch: int, max_new_tokens: int) -> dict:
    from fluxlab.llm import LLM

    overrides = ["engine.dtype=float32", "engine.device=cpu", f"decoding.block_length={BL}",
                 "model.max_model_len=256", f"scheduler.max_num_seqs={batch}",
                 f"scheduler.max_scheduled_tokens={max(128, 4 * batch * BL)}", f"parallel={layout}",
                 "parallel.startup_timeout_s=120"]
    llm = LLM(model="tiny_llada2", overrides=overrides)
    engine = llm.engine
    tp_size = llm.cfg.parallel.tp_size
    counts = {f"{key}_{unit}": 0 for key in ("step_broadcast", "vocab", "model_all_reduce") for unit in ("bytes", "s")}
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    step_s = []
    try:
        for i in range(batch):
            engine.add_request([(37 * i + 11 * j) % 1800 + 5 for j in range(24)], params)
        engine.step()  # prefill and the first decode
        if engine.runner.on_step is not None:  # rank 0 -> workers: the step message, however it travels
            send = engine.runner.on_step

            def timed_send(inputs):
                started = time.perf_counter()
                send(inputs)
                counts["step_broadcast_s"] += time.perf_counter() - started

            engine.runner.on_step = timed_send
        sent_before = getattr(engine, "step_bytes_sent", 0)
        with counting_collectives(tp_size, counts):
            while engine.has_unfinished():
                started = time.perf_counter()
                engine.step()
                step_s.append(time.perf_counter() - started)
        counts["step_broadcast_bytes"] = getattr(engine, "step_bytes_sent", 0) - sent_before
    finally:
        llm.shutdown()
    n = len(step_s)
    return {"layout": layout, "batch": batch, "steps": n, "step_ms": 1e3 * statistics.median(step_s),
            "step_broadcast_bytes": counts["step_broadcast_bytes"] / n, "vocab_bytes": counts["vocab_bytes"] / n,
            "step_broadcast_ms": 1e3 * counts["step_broadcast_s"] / n, "vocab_ms": 1e3 * counts["vocab_s"] / n, "all_reduce_ms": 1e3 * counts["model_all_reduce_s"] / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--layout", default="tp2")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", default="tp_overhead.json")
    args = parser.parse_args()
    os.environ.setdefault("FLUXLAB_WORKER_THREADS", "1")
    torch.set_num_threads(int(os.environ["FLUXLAB_WORKER_THREADS"]))
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        base = measure("single", batch, args.max_new_tokens)
        par = measure(args.layout, batch, args.max_new_tokens)
        rows.append({"batch": batch, "tp1_step_ms": base["step_ms"], "tp_step_ms": par["step_ms"],
                     "overhead_ms": par["step_ms"] - base["step_ms"], **{k: par[k] for k in
                     ("steps", "step_broadcast_bytes", "vocab_bytes", "step_broadcast_ms", "vocab_ms", "all_reduce_ms")}})
    with open(args.out, "w") as f:
        json.dump({"layout": args.layout, "rows": rows}, f, indent=2)
    print(f"{args.layout} vs tp1 on CPU gloo (tiny, fp32, block {BL}); per decode step, medians of time:")
    print(f"{'batch':>5} {'tp1 ms':>8} {args.layout + ' ms':>8} {'diff ms':>8} {'bcast B':>9} {'bcast ms':>8} "
          f"{'vocab B':>10} {'vocab ms':>8} {'allred ms':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['tp1_step_ms']:>8.2f} {r['tp_step_ms']:>8.2f} {r['overhead_ms']:>8.2f} "
              f"{r['step_broadcast_bytes']:>9.0f} {r['step_broadcast_ms']:>8.2f} {r['vocab_bytes']:>10.0f} "
              f"{r['vocab_ms']:>8.2f} {r['all_reduce_ms']:>9.2f}")


if __name__ == "__main__":
    main()
