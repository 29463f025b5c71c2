#!/bin/bash
# Issue 36.2/36.3 on one H200 (torch 2.11 + triton 3.6; run from the repo root with carry [".whl", ".base"]):
# A: GPU tests of the canvas kernels and Diffusion-Gemma batch invariance; B: which ops are batch-invariant
# (benchmarks/device/diffusion_gemma_invariance_probe.py); C: kernel profile of a denoising step at batch 1
# and 16 (diffusion_gemma_profile.py); D: fluxlab.bench.canvas with graphs, the baseline tree (.base: a
# `git archive` of the commit before this round; BASE="dir1 dir2" names others) then this tree, in one call
# (DG_BATCHES, default 1,16; QUANT=fp8 for model.quantization=fp8; PROMPT_TOKENS, default 256); T: the
# invariant matmul's tile sweep (diffusion_gemma_matmul_tiles.py; T_ARGS=--fp8 for the FP8 GEMM's); M: the fused
# MoE's tile sweep at 1 and 16 canvases with the bit check a per-batch config needs (diffusion_gemma_moe_tiles.py).
# Outputs under $OUT.
# Make .base here first (git-excluded): mkdir .base && git archive a284468 fluxlab conf hydra_plugins recipes \
#   sweeps pyproject.toml setup.py | tar -x -C .base ; echo /.base/ >> .git/info/exclude
# ~8-9 min with all steps: STEPS=ABD (the default ABCD adds the profile) keeps one call under 600 s.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out_dg}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
t() { echo "[t+${SECONDS}s] $*"; }
nvidia-smi -L 2>&1 | head -1
STEPS=${STEPS:-ABCD}
BASE=${BASE:-.base}
BENCH="--graphs on --batch-sizes ${DG_BATCHES:-1,16} --concurrency 1 --steps 16
  --prompt-tokens ${PROMPT_TOKENS:-256} --max-new-tokens 512 --repeats ${REPEATS:-5} --quantization ${QUANT:-none}"

if [[ $STEPS == *A* ]]; then
  t "A: gpu tests"
  A_TESTS=${A_TESTS:-"tests/test_canvas_moe.py tests/test_canvas_matmul.py tests/test_canvas_stats.py
    tests/test_canvas_gemma_norm.py tests/test_gpu_diffusion_gemma_invariance.py tests/test_canvas_graphs.py
    tests/test_canvas_route.py tests/test_canvas_attention.py tests/test_swiglu.py"}
  timeout ${A_TIMEOUT:-400} python3 -m pytest -m gpu -q -x -p no:cacheprovider -p no:warnings $A_TESTS \
    > "$OUT/dg_gpu_tests.log" 2>&1
  echo "A exit $?"
  grep -E "^(FAILED|ERROR)|^E |passed|failed|error" "$OUT/dg_gpu_tests.log" | cut -c1-300 | tail -25
fi
if [[ $STEPS == *B* ]]; then
  t "B: invariance probe"
  timeout 90 python3 benchmarks/device/diffusion_gemma_invariance_probe.py > "$OUT/dg_invariance_probe.log" 2>&1
  echo "B exit $?"; tail -20 "$OUT/dg_invariance_probe.log"
fi
if [[ $STEPS == *C* ]]; then
  t "C: profile"
  timeout 150 python3 benchmarks/device/diffusion_gemma_profile.py 1,16 > "$OUT/dg_profile.log" 2>&1
  echo "C exit $?"; grep -v "^\[" "$OUT/dg_profile.log" | tail -42 | cut -c1-150
fi
if [[ $STEPS == *D* ]]; then
  names=""
  for base in $BASE; do  # BASE may name several trees: "a b" -> dg_bench_a.json, dg_bench_b.json
    [[ -d $base ]] || continue
    name=$(basename $base); name=${name#.}; names="$names $name"
    t "D1: bench, baseline tree $base"
    (cd $base && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m fluxlab.bench.canvas $BENCH --out "$OUT/dg_bench_$name.json") \
      > "$OUT/dg_bench_$name.log" 2>&1
    echo "D1 exit $?"; grep -E "Traceback|Error" "$OUT/dg_bench_$name.log" | head -5
  done
  t "D2: bench, this tree"
  timeout 150 python3 -m fluxlab.bench.canvas $BENCH --out "$OUT/dg_bench_new.json" > "$OUT/dg_bench_new.log" 2>&1
  echo "D2 exit $?"; grep -E "Traceback|Error" "$OUT/dg_bench_new.log" | head -5
  for f in $names new; do
    echo "== $f"; [[ -f $OUT/dg_bench_$f.json ]] && python3 -c "import json, sys; from fluxlab.bench.canvas import print_table; print_table(json.load(open(sys.argv[1])))" "$OUT/dg_bench_$f.json" 2>&1 | tail -8
  done
fi
if [[ $STEPS == *T* ]]; then
  t "T: matmul tile sweep"
  timeout ${T_TIMEOUT:-120} python3 benchmarks/device/diffusion_gemma_matmul_tiles.py $T_ARGS "$OUT/dg_tiles.json" \
    > "$OUT/dg_tiles.log" 2>&1
  echo "T exit $?"; grep -v "^\[" "$OUT/dg_tiles.log" | tail -40 | cut -c1-200
fi
if [[ $STEPS == *M* ]]; then
  t "M: fused MoE tile sweep (per-batch config candidates)"
  timeout ${M_TIMEOUT:-150} python3 benchmarks/device/diffusion_gemma_moe_tiles.py "$OUT/dg_moe_tiles.json" > "$OUT/dg_moe_tiles.log" 2>&1
  echo "M exit $?"; grep -v "^\[" "$OUT/dg_moe_tiles.log" | tail -16 | cut -c1-200
fi
t done
