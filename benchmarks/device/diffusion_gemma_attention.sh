#!/bin/bash
# Issue 36 item 3 on one H200: Diffusion-Gemma's canvas attention, torch sdpa (the default) vs the batch-invariant
# Triton kernel (fluxlab/kernels/canvas_attention.py, attention=triton). Run from the repo root with carry [".whl"]:
#   OUT=$OUT bash benchmarks/device/run.sh diffusion_gemma_attention      (or STEPS=... bash this file)
# A: GPU tests: the kernel at 26B-A4B head shapes vs sdpa (fp32 and bf16), one engine forward vs sdpa (fp32, and
#    bf16 against sdpa with rounding noise), batch invariance at 1/8 with the kernel and graphs
#    (tests/test_canvas_attention.py), then the existing invariance test (sdpa), graphs and the canvas kernels' tests;
# K: one layer of each type alone at b1/b16, sdpa vs the kernel and its tile configs
#    (diffusion_gemma_attention_tiles.py; FLUXLAB_CANVAS_ATTENTION_CONFIG='{"512": [64, 32, 8, 2]}' sets a config);
# D: python -m fluxlab.bench.canvas at b1/b16 with graphs, --attention sdpa then --attention triton, same tree
#    (ATTENTIONS=triton runs only the kernel, when another step of the same call measured sdpa).
# ~9 min with all steps: STEPS=AK then STEPS=D keeps each call under 600 s. Outputs under $OUT.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out_dg_attention}
mkdir -p "$OUT"
if [[ -z $R ]] && compgen -G ".whl/*.whl" > /dev/null; then  # run alone (run.sh installs them itself)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site:$PWD
fi
t() { echo "[t+${SECONDS}s] $*"; }
nvidia-smi -L 2>&1 | head -1
STEPS=${STEPS:-AKD}
BENCH="--graphs on --batch-sizes 1,16 --concurrency 1 --steps 16 --prompt-tokens 256 --max-new-tokens 512 --repeats ${REPEATS:-3}"

if [[ $STEPS == *A* ]]; then
  t "A: gpu tests"
  A_TESTS=${A_TESTS:-"tests/test_canvas_attention.py tests/test_gpu_diffusion_gemma_invariance.py
    tests/test_canvas_graphs.py tests/test_canvas_gemma_norm.py tests/test_canvas_matmul.py tests/test_canvas_stats.py"}
  timeout ${A_TIMEOUT:-300} python3 -m pytest -m gpu -q -p no:cacheprovider -p no:warnings $A_TESTS \
    > "$OUT/dg_attention_gpu_tests.log" 2>&1
  echo "A exit $?"
  grep -E "^(FAILED|ERROR)|^E |passed|failed|error" "$OUT/dg_attention_gpu_tests.log" | cut -c1-300 | tail -25
fi
if [[ $STEPS == *K* ]]; then
  t "K: one layer alone, sdpa vs kernel tiles"
  timeout ${K_TIMEOUT:-150} python3 benchmarks/device/diffusion_gemma_attention_tiles.py "$OUT/dg_attention_tiles.json" \
    > "$OUT/dg_attention_tiles.log" 2>&1
  echo "K exit $?"; grep -v "^\[" "$OUT/dg_attention_tiles.log" | tail -45 | cut -c1-160
fi
if [[ $STEPS == *D* ]]; then
  for attention in ${ATTENTIONS:-sdpa triton}; do
    t "D: bench, attention=$attention"
    timeout ${D_TIMEOUT:-180} python3 -m fluxlab.bench.canvas $BENCH --attention $attention \
      --out "$OUT/dg_bench_$attention.json" > "$OUT/dg_bench_$attention.log" 2>&1
    echo "D $attention exit $?"; grep -E "Traceback|Error" "$OUT/dg_bench_$attention.log" | head -5
  done
  for attention in ${ATTENTIONS:-sdpa triton}; do
    echo "== $attention"; [[ -f $OUT/dg_bench_$attention.json ]] && python3 -c "import json, sys; from fluxlab.bench.canvas import print_table; print_table(json.load(open(sys.argv[1])))" "$OUT/dg_bench_$attention.json" 2>&1 | tail -8
  done
fi
t done
