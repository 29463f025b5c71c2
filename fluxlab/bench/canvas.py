"""Diffusion-Gemma canvas micro-benchmark (GPU): denoiser and commit forwards, then served tok/s.

    python -m fluxlab.bench.canvas [--preset diffusion_gemma_26b_a4b] [--batch-sizes 1,16,64]
        [--concurrency 1,16] [--steps 16] [--prompt-tokens 256] [--max-new-tokens 1024]
        [--graphs off|on|both] [--quantization none|fp8] [--attention auto|sdpa|triton] [--out FILE]

Random bf16 weights of the preset on the GPU (model.load_format=random). Part 1, per batch size B:
B requests whose prompt K/V is in the cache; "denoise" = one forward over B canvases + the canvas
decoder step (what a denoising step costs), "denoise_forward" = the forward and logits alone,
"commit" = one encoder forward writing B canvases' K/V (eager: a commit without a canvas to denoise
is rare in serving), "commit_denoise" = the step that commits a block and denoises the next canvas
(what the engine runs after a canvas is accepted; with graphs its commit graph). Part 2: requests
served through the engine with a fixed step count (max_denoising_steps = --steps,
confidence_threshold so small that no canvas stops early, EOS ignored), all at once at each
concurrency: output tokens / wall seconds, TPF. --graphs on: denoising steps, the forward alone and
commit + denoise steps replay the CUDA graphs (canvas_graphs.py, captured before timing); a commit
without a canvas and prefills of several blocks stay eager. --graphs both measures
off then on in one process (one 26B-A4B build); a failure of the graph half is recorded in the
JSON and the eager half still prints. Prints a table last; JSON to --out or $OUT/canvas_bench.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from fluxlab.engine.request import SamplingParams


def _engine(preset: str, max_num_seqs: int, pages_per_seq: int, smoke: bool, graph_rows: list[int],
            quantization: str = "none", attention: str = "auto"):
    from fluxlab.config.compose import compose
    from fluxlab.config.validate import validate_config
    from fluxlab.models.diffusion_gemma.engine import CanvasEngine

    if smoke:  # the tiny checkpoint on CPU: checks the script, measures nothing
        model = ["model=tiny_diffusion_gemma", "engine.dtype=float32", "engine.device=cpu"]
    else:
        model = ["model=diffusion_gemma", f"model.preset={preset}", "model.load_format=random", "engine.dtype=bfloat16",
                 "engine.device=cuda"]
    model.append(f"model.quantization={quantization}")  # fp8: the preset's random weights quantized at load
    model.append(f"attention={attention}")  # auto: the Triton canvas kernel on CUDA in bf16, sdpa on the smoke run
    cfg = compose("bench", model + ["tracking=none"])
    canvas = cfg.decoding.canvas_length
    graphs = ["attention.use_decode_cuda_graph=true",
              f"attention.cuda_graph_capture_bs=[{','.join(map(str, graph_rows))}]"] if graph_rows and not smoke else []
    cfg = compose("bench", model + graphs + ["tracking=none", f"scheduler.max_num_seqs={max_num_seqs}",
                                             f"scheduler.num_device_pages={max_num_seqs * pages_per_seq}",
                                             f"model.max_model_len={(pages_per_seq - 1) * canvas}",
                                             f"scheduler.max_scheduled_tokens={max_num_seqs * 2 * canvas}"])
    validate_config(cfg, cuda_available=not smoke)
    engine = CanvasEngine(cfg)
    if smoke and graph_rows:  # no CUDA on the smoke run: the same static path, called as is
        engine.runner.enable_denoise_graphs(graph_rows, capture=False)
    return engine


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    _sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync()
    return 1e3 * (time.perf_counter() - start) / repeats


def step_batches(engine, batch: int, prompt_tokens: int):
    """(decode, commit, commit_denoise) ScheduledBatches of `batch` rows of one canvas each, whose
    prompt K/V counts as cached: a denoising step, a commit alone, and a commit + denoise step."""
    from fluxlab.models.diffusion_gemma.request import CanvasRequest
    from fluxlab.models.diffusion_gemma.decoding import CanvasKnobs
    from fluxlab.engine.batch import ScheduledBatch, ScheduledRow

    runner, L = engine.runner, engine.block_length
    prompt_pages = -(-prompt_tokens // L)
    knobs = CanvasKnobs(**(engine.generation_defaults | {"max_denoising_steps": 10**6}))
    decode_rows, commit_rows = [], []
    for r in range(batch):
        request = CanvasRequest(f"bench-{r}", [1] * prompt_tokens, SamplingParams(max_new_tokens=2 * L, seed=r), L,
                                (), knobs)
        request.params = SamplingParams(max_new_tokens=2 * L, seed=r, temperature=0.0)
        first = r * (prompt_pages + 2)
        request.page_table = list(range(first, first + prompt_pages + 2))
        ring = runner.ring_size  # the sliding layers' ring of this seat (canvas_pages.py)
        request.sliding_pages = list(range(r * ring, r * ring + min(ring, len(request.page_table))))
        request.num_cached_blocks = request.active_block  # the prompt's K/V counts as cached
        decode_rows.append(ScheduledRow(request, request.active_block, 1, True))
        commit_rows.append(ScheduledRow(request, request.active_block, 1, False))
        start, end = request.block_range(request.active_block)
        request.tokens[start:end] = 1  # the committed canvas' tokens the commit forward reads
    # each row writes the block before its canvas (here the prompt's last) and denoises the canvas:
    # the engine's step after a canvas is accepted (the commit graph when graphs are on)
    commit_denoise = ScheduledBatch.of_rows([ScheduledRow(r.request, r.request.active_block - 1, 2, True)
                                             for r in decode_rows], L)
    return ScheduledBatch.of_rows(decode_rows, L), ScheduledBatch.of_rows(commit_rows, L), commit_denoise


def forward_times(engine, batch: int, prompt_tokens: int, repeats: int) -> dict:
    """ms of a denoising step, its forward alone and a commit, for `batch` rows of one canvas each."""
    from fluxlab.models.diffusion_gemma.paged_attention import build_canvas_metadata

    runner, L = engine.runner, engine.block_length
    decode, commit, commit_denoise = step_batches(engine, batch, prompt_tokens)
    decoding_requests = list(decode.requests)
    static = runner.graphs is not None and runner.graphs.can_run(decode)

    def forward_only_static():
        states = [runner._state(r) for r in decoding_requests]
        runner.graphs.denoiser(batch, runner.graphs.key_pages(decoding_requests), with_sampler=False).run(
            decoding_requests, states)

    def forward_only():
        rows, token_ids, positions, canvas_at, decoding, _ = runner._rows(decode)
        ids = torch.from_numpy(token_ids).to(runner.device)
        pos = torch.from_numpy(positions).to(runner.device)
        is_canvas = torch.ones(len(token_ids), dtype=torch.bool, device=runner.device)
        runner.attention.begin(build_canvas_metadata(rows, L, runner.model.sliding_window, runner.device,
                                                     masks=not runner.attention.kernel))
        hidden = runner.model(ids, pos, runner.attention, is_canvas)
        chunk = max(1, runner.step_elements // (L * runner.vocab_size))
        for lo in range(0, batch, chunk):  # the runner's chunked logits, without the sampler
            runner.model.compute_logits(hidden[lo * L:(lo + chunk) * L])

    with torch.inference_mode():
        out = {"batch": batch, "canvas": L, "prompt_tokens": prompt_tokens, "graphs": static,
               "denoise_ms": _time(lambda: runner.run(decode), repeats),
               "denoise_forward_ms": _time(forward_only_static if static else forward_only, repeats),
               "commit_ms": _time(lambda: runner.run(commit), repeats),
               "commit_denoise_ms": _time(lambda: runner.run(commit_denoise), repeats),
               "commit_graphs": runner.graphs is not None and runner.graphs.can_run(commit_denoise)}
    return out


def capture_served_graphs(engine, concurrency: int, prompt_tokens: int, max_new_tokens: int) -> None:
    """Capture before timing the graphs a served run meets (its rows, every key-page bucket)."""
    graphs, L = engine.runner.graphs, engine.block_length
    if graphs is None or concurrency > graphs.sizes[-1]:
        return

    class Prefix:  # the longest prefix a canvas of this run denoises against
        active_block, num_pad = -(-(prompt_tokens + max_new_tokens) // L) - 1, 0

    pages, largest = 1, graphs.key_pages([Prefix])
    with torch.inference_mode():
        while True:
            graphs.denoiser(concurrency, pages)
            graphs.denoiser(concurrency, pages, commits=True)  # the step after a canvas is accepted
            if pages >= largest:
                break
            pages = min(2 * pages, largest)


def served(engine, concurrency: int, steps: int, prompt_tokens: int, max_new_tokens: int) -> dict:
    capture_served_graphs(engine, concurrency, prompt_tokens, max_new_tokens)
    graph_forwards = engine.runner.num_graph_forwards
    params = SamplingParams(max_new_tokens=max_new_tokens, seed=0, ignore_eos=True, max_denoising_steps=steps,
                            confidence_threshold=1e-9)
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(prompt_tokens)] for i in range(concurrency)]
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(**{**params.__dict__, "seed": i}))
    finished, tokens, forwards, accepted = 0, 0, 0, 0
    _sync()
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                finished += 1
                forwards += out.stats.forwards
                accepted += out.stats.tokens_accepted
    _sync()
    wall = time.perf_counter() - start
    return {"concurrency": concurrency, "steps": steps, "graphs": engine.runner.graphs is not None,
            "graph_forwards": engine.runner.num_graph_forwards - graph_forwards, "output_tokens": tokens,
            "wall_s": wall,
            "tok_per_s": tokens / wall, "tpf": accepted / forwards if forwards else 0.0, "finished": finished}


def measure(engine, args, batches: list[int], concurrency: list[int], into: dict, save) -> None:
    """Each number into `into` as it comes, saved after each (a run cut short keeps what it had)."""
    into.update(forwards=[], served=[])
    for b in batches:
        into["forwards"].append(forward_times(engine, b, args.prompt_tokens, args.repeats))
        save()
    for c in concurrency:
        into["served"].append(served(engine, c, args.steps, args.prompt_tokens, args.max_new_tokens))
        save()


def print_table(results: dict) -> None:
    """The bench's table from its JSON ({mode: {forwards, served} or {error}}), also of a cut-short run."""
    print(f"\n{'graphs':>6} {'batch':>6} {'denoise ms':>11} {'forward ms':>11} {'commit ms':>10} "
          f"{'commit+denoise':>15}")
    for mode, r in results.items():
        if "attention" in r:
            print(f"{mode:>6} attention={r['attention']}")
        if "error" in r:
            print(f"{mode:>6} failed: {r['error'][:300]}")
        for f in r.get("forwards", []):
            print(f"{mode:>6} {f['batch']:>6} {f['denoise_ms']:>11.2f} {f['denoise_forward_ms']:>11.2f} "
                  f"{f['commit_ms']:>10.2f} {f.get('commit_denoise_ms', float('nan')):>15.2f}")
    print(f"\n{'graphs':>6} {'conc':>6} {'steps':>6} {'tok/s':>10} {'TPF':>6}")
    for mode, r in results.items():
        for f in r.get("served", []):
            print(f"{mode:>6} {f['concurrency']:>6} {f['steps']:>6} {f['tok_per_s']:>10.1f} {f['tpf']:>6.2f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="diffusion_gemma_26b_a4b")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--steps", type=int, default=None,
                        help="fixed denoising steps a canvas (default 16; 4 with --smoke, the tiny checkpoint's "
                             "ceiling is 8)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--graphs", choices=("off", "on", "both"), default="off",
                        help="denoiser CUDA graphs (attention.use_decode_cuda_graph) off, on, or off then on")
    parser.add_argument("--quantization", choices=("none", "fp8"), default="none",
                        help="model.quantization (fp8: e4m3 projections and experts, quantized at load)")
    parser.add_argument("--attention", choices=("auto", "sdpa", "triton"), default="auto",
                        help="attention: sdpa over gathered keys, or the batch-invariant Triton canvas kernel (CUDA); "
                             "auto = the serving default (the kernel on CUDA in bf16)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="the tiny checkpoint on CPU (checks the script)")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 4 if args.smoke else 16
    batches = [int(b) for b in args.batch_sizes.split(",")]
    concurrency = [int(c) for c in args.concurrency.split(",")]
    seqs = max(batches + concurrency)
    canvas = 8 if args.smoke else 256
    pages_per_seq = -(-(args.prompt_tokens + args.max_new_tokens) // canvas) + 2
    graph_rows = sorted(set(batches + concurrency)) if args.graphs != "off" else []
    engine = _engine(args.preset, seqs, pages_per_seq, args.smoke, graph_rows, args.quantization, args.attention)
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "canvas_bench.json")
    results = {}
    graphs = engine.runner.graphs
    def save():
        out.write_text(json.dumps(results, indent=2))

    for mode in (("off", "on") if args.graphs == "both" else (args.graphs,)):
        engine.runner.graphs = graphs if mode == "on" else None
        results[mode] = {"attention": "triton" if engine.runner.attention.kernel else "sdpa"}
        try:
            measure(engine, args, batches, concurrency, results[mode], save)
        except Exception as err:  # noqa: BLE001 - the other mode's numbers still print
            if args.graphs != "both":
                raise
            results[mode]["error"] = f"{type(err).__name__}: {err}"
            save()
    print_table(results)
    print(f"\nfull numbers: {out}")


if __name__ == "__main__":
    main()
