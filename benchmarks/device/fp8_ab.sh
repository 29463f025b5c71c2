#!/bin/bash
# A/B of the FP8 kernels between a baseline tree and a candidate, in one call (run from the repo root):
# CAND=a patch file (a candidate kernel change): this tree is the baseline and a copy of it
# with the patch applied (/tmp/cand) the candidate, carry [".whl"]; without CAND: BASE (default .head: a `git archive`
# of the commit before the change, fluxlab/assets left out) against this tree, carry [".whl", ".head"].
# T: the GPU tests in the candidate (TESTS, default the FP8 kernels', test_pdl's and the bf16 matmul's);
# K: benchmarks/device/fp8_ab.py in each tree, then its --compare (bits and graph-replay times per GEMM and MoE call);
# R: LLaDA2.0-mini fp8 decode / block at batch 1 and 64 (fluxlab.bench.roofline; R_ARGS), each tree, R_REPEATS times;
# D: Diffusion-Gemma 26B-A4B fp8 (DG_QUANT=none: bf16) denoising step at DG_BATCHES (default 1,16) and served c1
# (fluxlab.bench.canvas), each tree. STEPS picks (default TKRD). Outputs under $OUT.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out_fp8_ab}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
ROOT=$PWD
BASE=${BASE:-.head}
NEW=$ROOT
if [[ -n $CAND ]]; then
  rm -rf /tmp/cand && mkdir /tmp/cand
  cp -r fluxlab conf hydra_plugins recipes sweeps tests pyproject.toml setup.py /tmp/cand/
  [[ $CAND == /* ]] || CAND=$ROOT/$CAND
  (cd /tmp/cand && { patch -p1 -s < $CAND || git apply $CAND; }) || { echo "patch $CAND does not apply"; exit 1; }
  BASE=$ROOT NEW=/tmp/cand
fi
t() { echo "[t+${SECONDS}s] $*"; }
nvidia-smi -L 2>&1 | head -1
STEPS=${STEPS:-TKRD}
in_base() { (cd $BASE && PYTHONPATH=/tmp/site:$PWD "$@"); }
in_new() { (cd $NEW && PYTHONPATH=/tmp/site:$PWD "$@"); }
if [[ $STEPS == *T* ]]; then
  t "T: gpu tests"
  in_new timeout ${T_TIMEOUT:-200} python3 -m pytest -m gpu -q -p no:cacheprovider -p no:warnings \
    ${TESTS:-tests/test_fp8_kernels.py tests/test_pdl.py tests/test_canvas_matmul.py} > $OUT/gpu_tests.log 2>&1
  echo "T exit $?"; grep -E "^(FAILED|ERROR)|^E |passed|failed" $OUT/gpu_tests.log | cut -c1-240 | tail -12
fi
if [[ $STEPS == *K* ]]; then
  t "K: kernels, base"
  in_base timeout ${K_TIMEOUT:-150} python3 $ROOT/benchmarks/device/fp8_ab.py $OUT/kernels_base.pt \
    > $OUT/kernels_base.log 2>&1
  echo "exit $?"; tail -2 $OUT/kernels_base.log
  t "K: kernels, candidate"
  in_new timeout ${K_TIMEOUT:-150} python3 $ROOT/benchmarks/device/fp8_ab.py $OUT/kernels_new.pt \
    > $OUT/kernels_new.log 2>&1
  echo "exit $?"; tail -2 $OUT/kernels_new.log
  python3 benchmarks/device/fp8_ab.py --compare $OUT/kernels_base.pt $OUT/kernels_new.pt 2>&1 \
    | tee $OUT/kernels_compare.txt
fi
if [[ $STEPS == *R* ]]; then
  R=${R_ARGS:-"--batch-sizes 1,64 --variants triton+graph --quantization fp8"}  # R_ARGS without --quantization: bf16
  for i in $(seq ${R_REPEATS:-1}); do  # base and candidate alternated: b1 moves ~0.1 ms between runs of one tree
    t "R: LLaDA2.0-mini fp8, base ($i)"
    in_base timeout 110 python3 -m fluxlab.bench.roofline $R --out $OUT/roofline_base_$i.json 2>&1 \
      | grep -vi warn | tail -3
    t "R: candidate ($i)"
    in_new timeout 110 python3 -m fluxlab.bench.roofline $R --out $OUT/roofline_new_$i.json 2>&1 \
      | grep -vi warn | tail -3
  done
fi
if [[ $STEPS == *D* ]]; then
  D="--preset diffusion_gemma_26b_a4b --quantization ${DG_QUANT:-fp8} --graphs on --batch-sizes ${DG_BATCHES:-1,16}
    --concurrency 1 --steps 16 --prompt-tokens 256 --max-new-tokens 512 --repeats ${REPEATS:-3}"
  t "D: DG fp8, base"
  in_base timeout 150 python3 -m fluxlab.bench.canvas $D --out $OUT/dg_base.json > $OUT/dg_base.log 2>&1
  echo "exit $?"; grep -vi warn $OUT/dg_base.log | grep -v "^$" | tail -5
  t "D: candidate"; in_new timeout 150 python3 -m fluxlab.bench.canvas $D --out $OUT/dg_new.json > $OUT/dg_new.log 2>&1
  echo "exit $?"; grep -vi warn $OUT/dg_new.log | grep -v "^$" | tail -5
fi
t done
