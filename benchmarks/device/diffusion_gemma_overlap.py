"""The dense MLP beside the routed experts on a second stream (DiffusionGemmaModel.dense_beside_experts_),
26B-A4B shapes, random weights, canvas 256, CUDA graphs, one build for every variant (one lease, same weights).

python3 benchmarks/device/diffusion_gemma_overlap.py OUT.json [none|fp8] [0,1024,4096] [smoke]

For each max_tokens (0 = one stream, run first: the baseline): graphs released and captured again, the
denoising step at batch 1 and 16 (bench.canvas.forward_times), one served stream at 16 fixed steps
(bench.canvas.served), and the tokens of 4 requests generated together (512 new tokens each, seeds 0-3),
which must equal the one-stream run's: same kernels on the same inputs, so any difference is a race.
Prints a table last. `smoke`: the tiny checkpoint on the CPU, one stream only (checks the script).
"""
import json
import sys
import time

import torch

from fluxlab.bench.canvas import _engine, forward_times, served
from fluxlab.engine.request import SamplingParams

out_path = sys.argv[1] if len(sys.argv) > 1 else "overlap.json"
quantization = sys.argv[2] if len(sys.argv) > 2 else "none"
variants = [int(v) for v in (sys.argv[3] if len(sys.argv) > 3 else "0,1024,4096").split(",")]
smoke = sys.argv[4:] == ["smoke"]
PROMPT, NEW, STEPS = (16, 16, 4) if smoke else (256, 512, 16)


def tokens(engine) -> list[list[int]]:
    params = dict(max_new_tokens=NEW, ignore_eos=True, max_denoising_steps=STEPS, confidence_threshold=1e-9)
    ids = [engine.add_request([(11 * i + j) % 1000 + 10 for j in range(PROMPT)], SamplingParams(**params, seed=i))
           for i in range(4)]
    got: dict = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += list(out.new_token_ids)
    return [got[i] for i in ids]


engine = _engine("diffusion_gemma_26b_a4b", 16, 6, smoke, [1, 4, 16], quantization)
model = engine.runner.model
results = []
for max_tokens in variants:
    model.dense_beside_experts_(max_tokens)
    engine.runner.graphs.release()  # graphs hold the stream layout they were captured with
    started = time.perf_counter()
    row = {"max_tokens": max_tokens, "quantization": quantization,
           "forwards": [forward_times(engine, b, PROMPT, 5) for b in (1, 16)],
           "served_c1": served(engine, 1, STEPS, PROMPT, NEW), "tokens": tokens(engine)}
    row["seconds"] = time.perf_counter() - started
    results.append(row)
    json.dump(results, open(out_path, "w"), indent=1)

base = results[0]["tokens"]
print(f"\nquantization={quantization}  (max_tokens 0 = one stream)")
print(f"{'max_tokens':>10} {'b1 denoise ms':>14} {'b16 denoise ms':>15} {'c1 tok/s':>9} {'tokens = one stream':>20}")
for r in results:
    same = sum(a == b for a, b in zip(r["tokens"], base))
    print(f"{r['max_tokens']:>10} {r['forwards'][0]['denoise_ms']:>14.2f} {r['forwards'][1]['denoise_ms']:>15.2f} "
          f"{r['served_c1']['tok_per_s']:>9.1f} {same:>17}/4")
print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
