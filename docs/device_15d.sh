#!/bin/bash
# Issue 15d on one H200 (torch 2.11 + triton 3.6; PYTHONPATH set by the caller; run from the repo root):
# Diffusion-Gemma denoiser CUDA graphs. Part A: the GPU tests of the canvas engine (graph replay vs the
# static path called as is, vs eager at fp32, the generator-slot mechanism). Part B: fluxlab.bench.canvas
# with graphs off then on (one process, one 26B-A4B build), batch 1/16/64, canvas 256, served c1/c16.
# Each part runs under its own timeout and the next part runs whatever the last one did; ~235 s at most.
# Results: $OUT/gpu_tests_15d.log, $OUT/canvas_bench_15d.{log,json}; a short table is printed last.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out_15d}
mkdir -p "$OUT"
t() { echo "[t+${SECONDS}s] $*"; }
nvidia-smi -L 2>&1 | head -2
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tail -1
git log --oneline -1 2>/dev/null

t "A: gpu tests (tests/test_canvas*.py -m gpu)"
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -p no:warnings tests/test_canvas*.py \
  > "$OUT/gpu_tests_15d.log" 2>&1
echo "A exit $?"
grep -E "^(FAILED|ERROR)|^E |passed|failed|error" "$OUT/gpu_tests_15d.log" | cut -c1-240 | tail -20

t "B: bench.canvas --graphs both (26B-A4B shapes, random bf16)"
timeout 140 python3 -m fluxlab.bench.canvas --graphs both --batch-sizes 1,16,64 --concurrency 1,16 --steps 16 \
  --prompt-tokens 256 --max-new-tokens 512 --repeats 3 --out "$OUT/canvas_bench_15d.json" \
  > "$OUT/canvas_bench_15d.log" 2>&1
echo "B exit $?"
grep -E "Traceback|Error|captured|KV profile|engine ready" "$OUT/canvas_bench_15d.log" | cut -c1-240 | head -30

t "table"
python3 -c "import json, sys; from fluxlab.bench.canvas import print_table; print_table(json.load(open(sys.argv[1])))" \
  "$OUT/canvas_bench_15d.json" 2>&1 | tail -20
t done
