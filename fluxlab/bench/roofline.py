"""Decode-step micro-benchmark against the roofline floor (GPU).

    python -m fluxlab.bench.roofline [--preset llada2_mini] [--batch-sizes 1,8,16,32,64]
        [--variants sdpa,flashinfer,flashinfer+graph,fa4+graph] [--reference]
        [--ttft-variants flashinfer+graph,flashinfer+graph+prefill,fa4+graph,fa4+graph+prefill --concurrency 16]

Builds random bf16 weights of a preset on the GPU, measures the two ceilings (HBM copy bandwidth,
bf16 matmul rate) in the same run, then for each variant and batch size runs GSM8K-style prompts
to 256 output tokens at block 32, decoding.steps=8 (random weights never pass the threshold, so
every step accepts exactly 4 tokens and runs are comparable) and reports ms per pure decode
forward, its floor and output tokens/s. Two floors: `decode_floor`'s floor_ms, the larger of the
forward's weight-streaming and FLOP times, and the serial floor (`serial_floor`), its stages' floors
added up, because a layer's stages wait for each other (the per-block floor adds steps - 1 decode
forwards and the commit forward). A variant is backend[+graph][+prefill]: +graph captures the
decode graphs, +prefill also the prefill graphs of --prefill-tokens (attention.use_prefill_cuda_graph).
--ttft-variants submits --concurrency prompts at once, one block each, and reports the time to each
request's first committed block beside its floor (the prefill forward's, then steps - 1 decode
forwards at that batch). Writes JSON to --out (or $OUT/roofline.json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from fluxlab.engine.chat import encode_chat
from fluxlab.engine.request import SamplingParams


def measure_ceilings() -> dict:
    """HBM copy bandwidth (read + write bytes/s) and bf16 matmul FLOP/s, measured now on this GPU."""
    from fluxlab.bench.moe_layer import measure_ceilings as measure

    ceilings = measure()
    return {"hbm_bytes_per_s": ceilings["copy_bytes_per_s"], "bf16_flops_per_s": ceilings["bf16_flops_per_s"]}


def decode_floor(config, batch: int, block: int, context_tokens: int, ceilings: dict, kv_bytes: int = 2,
                 fp8_weights: bool = False) -> dict:
    """Bytes a decode forward must read (weights it touches + cached K/V) and FLOPs it must do:
    floor_ms is the larger of the two times (issue 7's floor), serial_floor_ms the stages' floors
    in sequence (`serial_floor`) with the masked half of the block's rows through the lm_head. kv_bytes: a
    cached K or V value's size (1 for model.kv_cache_dtype=fp8_e4m3). fp8_weights (model.quantization=fp8):
    the projections' and experts' weights at one byte and their products at twice the bf16 rate (e4m3 MMAs);
    the router and the lm_head stay bf16."""
    c = config
    h, heads, kv, d = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    attn = h * (heads + 2 * kv) * d + heads * d * h
    dense_mlp = 3 * h * c.intermediate_size
    expert = 3 * h * c.moe_intermediate_size
    shared = expert * _shared_experts(c)
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    dense_layers = c.num_hidden_layers - moe_layers
    tokens = batch * block
    hit = experts_hit(c, tokens)
    quantized_read = c.num_hidden_layers * attn + dense_layers * dense_mlp + moe_layers * (shared + hit * expert)
    plain_read = moe_layers * h * c.num_experts + c.vocab_size * h
    quantized_active = (c.num_hidden_layers * attn + dense_layers * dense_mlp
                        + moe_layers * (shared + c.num_experts_per_tok * expert))
    plain_active = moe_layers * h * c.num_experts + c.vocab_size * h
    kv_read = batch * context_tokens * c.num_hidden_layers * 2 * kv * d * kv_bytes
    weight_bytes, speedup = (1, 2) if fp8_weights else (2, 1)
    attention_flops = 4 * batch * block * context_tokens * heads * d * c.num_hidden_layers
    memory_s = (weight_bytes * quantized_read + 2 * plain_read + kv_read) / ceilings["hbm_bytes_per_s"]
    compute_s = (2 * quantized_active * tokens / speedup + 2 * plain_active * tokens
                 + attention_flops) / ceilings["bf16_flops_per_s"]
    # decoding.steps fixed: the decode forwards of a block see block - k * block / steps masks,
    # k = 1 .. steps - 1, block / 2 on average (the first step runs in the commit forward)
    serial = serial_floor(c, batch, block, batch * block // 2, context_tokens, ceilings, kv_bytes, fp8_weights)
    # the commit forward: the finished block (K/V only, no logits) and the next block's first step
    commit = serial_floor(c, batch, 2 * block, batch * block, context_tokens, ceilings, kv_bytes, fp8_weights)
    return {"floor_ms": 1e3 * max(memory_s, compute_s), "memory_ms": 1e3 * memory_s, "compute_ms": 1e3 * compute_s,
            "serial_floor_ms": sum(serial.values()), "serial_stages_ms": serial,
            "commit_serial_floor_ms": sum(commit.values())}


def experts_hit(config, tokens: int) -> float:
    """Distinct experts a layer's tokens route to if routing spreads them uniformly (random
    weights do, nearly)."""
    c = config
    if not c.num_experts:  # a dense model (SDAR-8B)
        return 0.0
    return c.num_experts * (1 - (1 - c.num_experts_per_tok / c.num_experts) ** tokens)


def _shared_experts(config) -> int:
    """LLaDA2's always-on experts; families without them (SDAR's Qwen3-MoE layout) have none."""
    return getattr(config, "num_shared_experts", 0) or 0


def serial_floor(config, batch: int, rows: int, logit_rows: int, context_tokens: float, ceilings: dict,
                 kv_bytes: int = 2, fp8_weights: bool = False) -> dict[str, float]:
    """ms per stage of a forward whose stages run one after another, each at the larger of its
    weight-streaming time and its FLOP time: a layer's experts wait for its attention, the next
    layer for its experts, so a memory-bound stage cannot hide a compute-bound one. batch requests
    of `rows` rows each through the layers, each attending to context_tokens cached keys;
    logit_rows rows in all through the lm_head. Activation traffic (norms, the experts' combine,
    the logits) is left out: a lower bound on the forward, tighter than `decode_floor`'s max.
    kv_bytes and fp8_weights as in `decode_floor`."""
    c = config
    bw, peak = ceilings["hbm_bytes_per_s"], ceilings["bf16_flops_per_s"]
    h, heads, kv, d = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    layers = c.num_hidden_layers
    moe_layers = sum(c.is_moe_layer(i) for i in range(layers))
    expert = 3 * h * c.moe_intermediate_size
    tokens = batch * rows
    weight_bytes, rate = (1, 2 * peak) if fp8_weights else (2, peak)

    def gemm(params: int, rows_in: int, count: int, quantized: bool = True) -> float:  # rows_in rows, count times
        if not quantized:
            return 1e3 * count * max(2 * params / bw, 2 * params * rows_in / peak)
        return 1e3 * count * max(weight_bytes * params / bw, 2 * params * rows_in / rate)

    kv_read = batch * context_tokens * 2 * kv * d * kv_bytes
    attention_flops = 4 * tokens * context_tokens * heads * d
    return {
        "attention projections": gemm(h * (heads + 2 * kv) * d + heads * d * h, tokens, layers),
        "attention": 1e3 * layers * max(kv_read / bw, attention_flops / peak),
        "dense mlp": gemm(3 * h * c.intermediate_size, tokens, layers - moe_layers),
        "router + shared experts": (gemm(h * c.num_experts, tokens, moe_layers, quantized=False)
                                    + gemm(expert * _shared_experts(c), tokens, moe_layers)),
        "routed experts": 1e3 * moe_layers * max(weight_bytes * experts_hit(c, tokens) * expert / bw,
                                                 2 * expert * tokens * c.num_experts_per_tok / rate),
        "lm head": gemm(c.vocab_size * h, logit_rows, 1, quantized=False),
    }


def gsm8k_prompts(tokenizer, count: int) -> list[list[int]]:
    from fluxlab.bench.workload import sample_jsonl_path as sample_path

    prompts = []
    with open(sample_path()) as f:
        for line in f:
            messages = json.loads(line)["messages"]
            prompts.append(encode_chat(tokenizer, messages))
    return [prompts[i % len(prompts)] for i in range(count)]


def _num(value: Optional[float], digits: int = 2) -> str:
    """A median for the tables; '-' where no forward of that kind ran (e.g. a batch whose requests
    never all ran in one phase)."""
    return "-" if value is None else f"{value:.{digits}f}"


def forward_kind(running: list, num_waiting: int, batch: int) -> str:
    """decode: all `batch` requests running, each on one uncached block; commit: all running, each
    committing its block and starting the next; other: the rest (prefill, mixed phases, and a batch
    whose first requests have finished, which would otherwise time a smaller batch as this one)."""
    if num_waiting or len(running) != batch:
        return "other"
    uncached = {r.active_block - r.num_cached_blocks for r in running}
    return {0: "decode", 1: "commit"}.get(uncached.pop(), "other") if len(uncached) == 1 else "other"


def run_batch(engine, prompts: list[list[int]], max_new_tokens: int, steps: int) -> dict:
    """All prompts at once; time every forward, by kind: decode (every row one active block),
    commit (every row commits a block and starts the next), other (prefill, mixed)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, steps=steps, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    times: dict[str, list[float]] = {"decode": [], "commit": [], "other": []}
    host: dict[str, list[float]] = {"decode": [], "commit": [], "other": []}
    runner = engine.runner
    graph_before = getattr(runner, "num_graph_forwards", 0)
    eager_before = getattr(runner, "num_eager_forwards", 0)
    ahead_before = engine.total_launched_ahead
    outputs = 0
    torch.cuda.synchronize()
    started = time.perf_counter()
    while engine.has_unfinished():
        kind = forward_kind(engine.scheduler.running, len(engine.scheduler.waiting), len(prompts))
        t0 = time.perf_counter()
        for out in engine.step():
            outputs += len(out.new_token_ids)
        if not engine.forward_in_flight:  # (a forward launched ahead runs on)
            torch.cuda.synchronize()
        times[kind].append(1e3 * (time.perf_counter() - t0))
        # GPU idle for this step's host work: up to its launch (unless the last step launched it),
        # and from its results to the next launch (async scheduling) or to the step's end
        host[kind].append(1e3 * engine.last_step_host_seconds)
    elapsed = time.perf_counter() - started
    median = {k: statistics.median(v) if v else None for k, v in times.items()}
    host_median = {k: statistics.median(v) if v else None for k, v in host.items()}
    replays = getattr(runner, "num_graph_forwards", 0) - graph_before
    eager = getattr(runner, "num_eager_forwards", 0) - eager_before
    return {"decode_ms_median": median["decode"], "commit_ms_median": median["commit"],
            "other_ms_median": median["other"], "host_decode_ms_median": host_median["decode"],
            "host_commit_ms_median": host_median["commit"],
            "graph_share": replays / (replays + eager) if replays + eager else None,
            "ahead_share": (engine.total_launched_ahead - ahead_before) / (replays + eager) if replays + eager else None,
            "forwards": sum(len(v) for v in times.values()),
            "output_tokens": outputs, "output_tok_s": outputs / elapsed, "elapsed_s": elapsed}


def run_ttft(engine, prompts: list[list[int]], steps: int, block: int) -> dict:
    """Every prompt at once (concurrency = len(prompts)), one block each: the time from submission to
    each request's first committed block, and the first (prefill) forward's time."""
    params = SamplingParams(max_new_tokens=block, steps=steps, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    ids = {engine.add_request(p, params) for p in prompts}
    first: dict[str, float] = {}
    step_ms = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        step_ms.append(1e3 * (now - t0))
        for out in outs:
            if out.new_token_ids and out.request_id in ids and out.request_id not in first:
                first[out.request_id] = 1e3 * (now - started)
    ttft = sorted(first.values())
    return {"ttft_ms_median": statistics.median(ttft), "ttft_ms_mean": statistics.mean(ttft),
            "ttft_ms_max": ttft[-1], "first_forward_ms": step_ms[0], "forwards": len(step_ms)}


def profile_decode(engine, prompts: list[list[int]], steps: int) -> None:
    """Kernel time breakdown over one block of decode steps (graph replays included)."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_new_tokens=64, steps=steps, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60), flush=True)
    while engine.has_unfinished():
        engine.step()


def main() -> None:
    from fluxlab.config import compose, validate_config
    from fluxlab.engine.factory import make_engine
    from fluxlab.engine.llm_engine import LLMEngine

    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llada2_mini")
    ap.add_argument("--batch-sizes", default="1,8,16,32,64")
    ap.add_argument("--variants", default="sdpa,flashinfer,flashinfer+graph")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--reference", action="store_true", help="also time the reference generate at batch 1")
    ap.add_argument("--moe-backend", default=None)
    ap.add_argument("--quantization", default="none", help="model.quantization (fp8: block-scaled FP8 weights)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="model.kv_cache_dtype (fp8_e4m3: e4m3 KV pages, read by "
                                                              "the sdpa and triton variants only)")
    ap.add_argument("--decoding", default=None, help="a decoding group (joint_threshold, levenshtein_joint, ...)")
    ap.add_argument("--profile", action="store_true", help="print the GPU kernel time table of decode steps")
    ap.add_argument("--parallel", default=None, help="a parallel group (tp2_ep2, tp4_ep4): one engine per variant")
    ap.add_argument("--ttft-variants", default="",
                    help="variants timed for TTFT instead of decode (+prefill: prefill graphs of --prefill-tokens)")
    ap.add_argument("--concurrency", type=int, default=16, help="prompts submitted at once for the TTFT variants")
    ap.add_argument("--prefill-tokens", default="1024,2048,4096", help="prefill graph capture sizes (tokens)")
    ap.add_argument("--ttft-prompt-tokens", type=int, default=0,
                    help="TTFT prompts of this many tokens (GSM8K prompts joined end to end); 0: the prompts as they are")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "roofline.json"))
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    prefill_tokens = [int(t) for t in args.prefill_tokens.split(",")]
    max_bs = max(sizes)
    overrides = ([f"decoding={args.decoding}"] if args.decoding else []) + [
                 f"model={args.preset}", "model.load_format=random", "engine.device=cuda", "engine.dtype=bfloat16",
                 f"decoding.block_length={args.block}", f"decoding.steps={args.steps}", "attention=sdpa",
                 f"scheduler.max_num_seqs={max_bs}",
                 f"scheduler.max_scheduled_tokens={max(max_bs * args.block * 2, args.ttft_prompt_tokens)}",
                 f"model.max_model_len={max(1024, args.ttft_prompt_tokens + 2 * args.block)}",
                 "scheduler.enable_prefix_cache=false"]  # repeated prompts must prefill again (TTFT trials)
    if args.moe_backend:
        overrides.append(f"engine.moe_backend={args.moe_backend}")
    if args.quantization != "none":
        overrides.append(f"model.quantization={args.quantization}")
    if args.kv_cache_dtype != "auto":
        overrides.append(f"model.kv_cache_dtype={args.kv_cache_dtype}")
    if args.parallel:
        overrides.append(f"parallel={args.parallel}")
    cfg = compose("generate", overrides)
    validate_config(cfg)
    tp = cfg.parallel.tp_size
    ceilings = measure_ceilings()
    print(f"ceilings: HBM copy {ceilings['hbm_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 matmul {ceilings['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    if tp > 1:  # each rank streams its own shard: the floor uses the HBM and FLOPs of all tp GPUs
        ceilings = {k: v * tp for k, v in ceilings.items()}

    def variant_engine(variant: str, decode_segments: Optional[set[int]] = None):
        """Single GPU: swap the runner of one engine. TP: a fresh engine (its workers own runners)."""
        backend, *flags = variant.split("+")
        graphs = "graph" in flags
        if tp > 1:
            extra = [f"attention={backend}"] + ([
                "attention.use_decode_cuda_graph=true", f"attention.cuda_graph_capture_bs=[{','.join(map(str, sizes))}]"]
                if graphs else [])
            vcfg = compose("generate", overrides + extra)
            validate_config(vcfg)
            return make_engine(vcfg)
        engine.runner = engine.make_runner(backend)
        if graphs:
            t0 = time.perf_counter()
            segments = sorted(decode_segments or {n for b in sizes for n in (b, 2 * b)})
            if "prefill" in flags:  # attention.use_prefill_cuda_graph: capture sizes in tokens
                segments = sorted(set(segments) | {t // args.block for t in prefill_tokens})
            engine.runner.capture_graphs(segments, "padded")
            print(f"{variant}: captured {segments} segments in {time.perf_counter() - t0:.1f} s", flush=True)
        return engine

    t0 = time.perf_counter()
    engine = LLMEngine(cfg) if tp == 1 else None
    if engine is not None:
        print(f"engine built in {time.perf_counter() - t0:.1f} s ({engine.kv_total_pages} KV pages)", flush=True)
    from fluxlab.engine.loading import load_tokenizer

    prompts = gsm8k_prompts(load_tokenizer(None), max(max_bs, args.concurrency))
    mean_prompt = statistics.mean(len(p) for p in prompts)
    results = {"ceilings": ceilings, "preset": args.preset, "kv_cache_dtype": args.kv_cache_dtype,
               "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__, "rows": []}
    for variant in filter(None, args.variants.split(",")):
        run_engine = None
        try:
            t0 = time.perf_counter()
            run_engine = variant_engine(variant)
            print(f"{variant}: engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
            run_batch(run_engine, prompts[:1], 64, args.steps)  # warm-up (JIT, allocator)
            if args.profile:
                profile_decode(run_engine, prompts[:sizes[0]], args.steps)
            for bs in sizes:
                stats = run_batch(run_engine, prompts[:bs], args.max_new_tokens, args.steps)
                context = mean_prompt + args.max_new_tokens / 2
                floor = decode_floor(run_engine.model_config, bs, args.block, context, ceilings,
                                     kv_bytes=1 if args.kv_cache_dtype == "fp8_e4m3" else 2,
                                     fp8_weights=args.quantization == "fp8")
                row = {"variant": variant, "batch": bs, "tp": tp, **stats, **floor}
                row["ratio"] = row["decode_ms_median"] / floor["floor_ms"] if row["decode_ms_median"] else None
                # one block: steps - 1 decode forwards and the commit forward that starts it
                row["block_serial_floor_ms"] = ((args.steps - 1) * floor["serial_floor_ms"]
                                                + floor["commit_serial_floor_ms"])
                if row["decode_ms_median"] and row["commit_ms_median"]:
                    row["block_ms"] = (args.steps - 1) * row["decode_ms_median"] + row["commit_ms_median"]
                results["rows"].append(row)
                print(f"{variant:>18} bs={bs:>3}: decode {_num(row['decode_ms_median'])} ms (floor {floor['floor_ms']:.2f}, "
                      f"x{_num(row['ratio'])}), commit {_num(row['commit_ms_median'])} ms, other {_num(row['other_ms_median'])} ms, "
                      f"host {row['host_decode_ms_median'] or 0:.3f} ms/decode step, {row['host_commit_ms_median'] or 0:.3f} "
                      f"ms/commit step, graphs {row['graph_share'] or 0:.0%}, launched ahead {row['ahead_share'] or 0:.0%}, "
                      f"{row['output_tok_s']:.0f} tok/s",
                      flush=True)
        except Exception as err:  # one broken variant must not hide the others' numbers
            import traceback

            traceback.print_exc()
            results["rows"].append({"variant": variant, "error": repr(err)})
        if tp > 1 and run_engine is not None:
            run_engine.shutdown()
        elif engine is not None:
            engine.runner = None
        torch.cuda.empty_cache()
    if args.ttft_variants and engine is not None:
        # The engine's graph sizes at scheduler.max_num_seqs=concurrency (graph_runner.graph_segment_sizes):
        # decode graphs {b, 2b} for b = 1, 2, 4, ..., concurrency and the ladder up to 2 * concurrency.
        from fluxlab.engine.graph_runner import ladder_sizes

        conc = args.concurrency
        capture_bs = {min(2 ** i, conc) for i in range(conc.bit_length())} | {conc}
        decode_segments = {n for b in capture_bs for n in (b, 2 * b)}
        decode_segments |= ladder_sizes(max(decode_segments))
        ttft_prompts = prompts[:conc]
        if args.ttft_prompt_tokens:  # long prompts: each one GSM8K prompts joined until it is long enough
            n = args.ttft_prompt_tokens
            joined = [t for p in prompts for t in p]
            joined *= (n + 97 * conc) // len(joined) + 1
            ttft_prompts = [joined[i * 97:i * 97 + n] for i in range(conc)]  # different starts: no shared prefix
        segments = sum(len(p) // args.block + 1 for p in ttft_prompts)
        mean_len = statistics.mean(len(p) for p in ttft_prompts)
        prefill_floor = decode_floor(engine.model_config, segments, args.block, mean_len / 2, ceilings)["floor_ms"]
        step_floor = decode_floor(engine.model_config, conc, args.block, mean_len, ceilings)["floor_ms"]
        ttft_floor = prefill_floor + (args.steps - 1) * step_floor  # prefill (+ first step), then steps - 1 more
        results["ttft"] = {"concurrency": conc, "prompt_tokens": mean_len, "prefill_segments": segments,
                           "floor_ms": ttft_floor, "prefill_floor_ms": prefill_floor, "rows": []}
        for variant in filter(None, args.ttft_variants.split(",")):
            try:
                run_engine = variant_engine(variant, decode_segments)
                run_ttft(run_engine, ttft_prompts, args.steps, args.block)  # warm-up (JIT at these shapes)
                trials = [run_ttft(run_engine, ttft_prompts, args.steps, args.block) for _ in range(3)]
                row = {"variant": variant, **min(trials, key=lambda t: t["ttft_ms_median"]),
                       "ttft_ms_median_trials": [t["ttft_ms_median"] for t in trials],
                       "graph_share": run_engine.runner.num_graph_forwards
                       / max(1, run_engine.runner.num_graph_forwards + run_engine.runner.num_eager_forwards)}
                results["ttft"]["rows"].append(row)
                print(f"{variant:>26} TTFT c={conc}: median {row['ttft_ms_median']:.1f} ms (trials "
                      f"{', '.join(f'{t:.1f}' for t in row['ttft_ms_median_trials'])}), first forward "
                      f"{row['first_forward_ms']:.1f} ms, floor {ttft_floor:.1f} ms", flush=True)
            except Exception as err:
                import traceback

                traceback.print_exc()
                results["ttft"]["rows"].append({"variant": variant, "error": repr(err)})
            engine.runner = None
            torch.cuda.empty_cache()
    if args.reference and engine is not None:
        from fluxlab.engine.layers.moe import StackedExperts
        from fluxlab.models.llada2.reference import reference_generate

        # Same algorithm twice: with fluxlab's model code, and with the published code's per-expert
        # MoE loop (what the checkpoint's own generate() runs).
        results["reference"] = {}
        resolved = next(m.backend for m in engine.model.modules() if isinstance(m, StackedExperts))
        for label, backend, tokens in (("fluxlab model", resolved, args.max_new_tokens),
                                       ("per-expert loop", "loop", 64)):
            for module in engine.model.modules():
                if isinstance(module, StackedExperts):
                    module.backend = backend
            t0 = time.perf_counter()
            ref = reference_generate(engine.model, prompts[0], mask_id=engine.mask_id, eos_id=engine.eos_id,
                                     block_length=args.block, steps=args.steps, max_new_tokens=tokens,
                                     ignore_eos=True)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            results["reference"][label] = {"output_tok_s": len(ref.token_ids) / elapsed, "forwards": ref.forwards,
                                           "elapsed_s": elapsed, "tokens": len(ref.token_ids)}
            print(f"reference generate bs=1 ({label}): {len(ref.token_ids) / elapsed:.1f} tok/s "
                  f"({ref.forwards} forwards, {len(ref.token_ids)} tokens)", flush=True)
    print("\n| variant | batch | ms/decode fwd | floor ms | x floor | serial floor ms | commit fwd ms | commit serial "
          "floor ms | block ms | block serial floor ms | other fwd ms | out tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in results["rows"]:
        if "error" in row:
            print(f"| {row['variant']} | - | error: {row['error'][:60]} | | | | | | | | | |")
            continue
        print(f"| {row['variant']} | {row['batch']} | {_num(row['decode_ms_median'])} | {row['floor_ms']:.2f} | "
              f"{_num(row['ratio'])} | {row['serial_floor_ms']:.2f} | {_num(row['commit_ms_median'])} | "
              f"{row['commit_serial_floor_ms']:.2f} | {_num(row.get('block_ms'), 1)} | {row['block_serial_floor_ms']:.1f} | "
              f"{row['other_ms_median'] or 0:.2f} | {row['output_tok_s']:.0f} |")
    if "ttft" in results:
        t = results["ttft"]
        print(f"\n| variant | TTFT median ms (c={t['concurrency']}) | first (prefill) forward ms | TTFT floor ms | x floor | graph share |")
        print("|---|---|---|---|---|---|")
        for row in t["rows"]:
            if "error" in row:
                print(f"| {row['variant']} | error: {row['error'][:60]} | | | | |")
                continue
            print(f"| {row['variant']} | {row['ttft_ms_median']:.1f} | {row['first_forward_ms']:.1f} | "
                  f"{t['floor_ms']:.1f} | {row['ttft_ms_median'] / t['floor_ms']:.2f} | {row['graph_share']:.0%} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
