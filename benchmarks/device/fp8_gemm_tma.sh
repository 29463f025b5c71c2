# The FP8 GEMM's TMA tiles (kernels/fp8_gemm.py, under CUDA graphs): KERNELS=1 runs benchmarks/device/fp8_gemm_tma.py
# (bits and graph-replay times against pointer loads); then, alternating `pointers` (FLUXLAB_FP8_GEMM='{"TMA":0}')
# and `tma` (the default), LLaDA2.0-mini's fp8 decode forward at b1/b64 for each of LLADA_RUNS and Diffusion-Gemma's
# fp8 denoising step at DG_BATCHES (default 1,16) with a served c1 stream for each of DG_RUNS. TESTS=1 first runs the
# FP8 GPU tests.
if [ "${TESTS:-0}" = 1 ]; then
  timeout ${TTIMEOUT:-120} python3 -m pytest -q -m gpu tests/test_fp8_kernels.py -p no:cacheprovider 2>&1 | tail -3
fi
if [ "${KERNELS:-0}" = 1 ]; then
  timeout ${KTIMEOUT:-150} python3 benchmarks/device/fp8_gemm_tma.py $OUT/fp8_gemm_tma.json 2>&1 | grep -vi warn \
    | tee $OUT/fp8_gemm_tma.txt | tail -12
fi
with() {  # with RUN CMD...
  local v=$1; shift
  if [ "$v" = pointers ]; then FLUXLAB_FP8_GEMM='{"TMA":0}' "$@"; else "$@"; fi
}
i=0
for v in ${LLADA_RUNS:-pointers tma pointers tma}; do
  i=$((i + 1)); echo "LLaDA2.0-mini fp8, run $i: $v"
  with $v timeout 100 python3 -m fluxlab.bench.roofline --batch-sizes 1,64 --variants triton+graph --quantization fp8 \
    --out $OUT/roofline_${i}_$v.json 2>&1 | grep -vi warn | tail -2
done
for v in ${DG_RUNS:-pointers tma}; do
  with $v timeout ${DG_TIMEOUT:-150} python3 -m fluxlab.bench.canvas --preset diffusion_gemma_26b_a4b --quantization fp8 \
    --graphs on --batch-sizes ${DG_BATCHES:-1,16} --concurrency 1 --steps 16 --prompt-tokens 256 --max-new-tokens 512 \
    --repeats 3 --out $OUT/dg_$v.json > $OUT/dg_$v.log 2>&1
  echo "DG fp8 $v exit $?"; grep -vi warn $OUT/dg_$v.log | grep -v "^$" | tail -6
done
