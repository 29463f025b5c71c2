# FP8 TMA tiles and paired K-blocks (benchmarks/device/fp8_tma_pairs.py): the kernel sweep with its bit check under
# CUDA graphs, then the decode forward of LLaDA2.0-mini (fp8, b1/b64) for each of LLADA_RUNS and Diffusion-Gemma's fp8
# denoising step at batch 1 with a served c1 stream for each of DG_RUNS. A run is `shipped` (no switch), `on`
# (FLUXLAB_FP8_GEMM=$ON_GEMM, FLUXLAB_FP8_MOE_CONFIG=$ON_MOE) or `all` ($ALL_GEMM, $ON_MOE). TESTS=1 adds the FP8
# GPU tests under `all`. KERNELS=0 skips the sweep.
ON_GEMM=${ON_GEMM:-'{"TMA_ROWS":1024}'}; ALL_GEMM=${ALL_GEMM:-'{"TMA_ROWS":1}'}; ON_MOE=${ON_MOE:-'{"TMA1":1}'}
with() {  # with RUN CMD...: CMD under RUN's switches
  local v=$1; shift
  case $v in
    shipped) "$@" ;;
    on) FLUXLAB_FP8_GEMM=$ON_GEMM FLUXLAB_FP8_MOE_CONFIG=$ON_MOE "$@" ;;
    all) FLUXLAB_FP8_GEMM=$ALL_GEMM FLUXLAB_FP8_MOE_CONFIG=$ON_MOE "$@" ;;
  esac
}
if [ "${KERNELS:-1}" = 1 ]; then
  timeout ${KTIMEOUT:-200} python3 benchmarks/device/fp8_tma_pairs.py $OUT/fp8_tma_pairs.json 2>&1 | grep -vi warn \
    | tee $OUT/fp8_tma_pairs.txt | tail -40
fi
i=0
for v in ${LLADA_RUNS:-shipped on shipped on}; do
  i=$((i + 1)); echo "LLaDA2.0-mini fp8, run $i: $v"
  with $v timeout 100 python3 -m fluxlab.bench.roofline --batch-sizes 1,64 --variants triton+graph --quantization fp8 \
    --out $OUT/roofline_${i}_$v.json 2>&1 | grep -vi warn | tail -2
done
for v in ${DG_RUNS:-shipped on all}; do
  with $v timeout ${DG_TIMEOUT:-130} python3 -m fluxlab.bench.canvas --preset diffusion_gemma_26b_a4b --quantization fp8 \
    --graphs on --batch-sizes 1 --concurrency 1 --steps 16 --prompt-tokens 256 --max-new-tokens 512 --repeats 3 \
    --out $OUT/dg_$v.json > $OUT/dg_$v.log 2>&1
  echo "DG fp8 $v exit $?"; grep -vi warn $OUT/dg_$v.log | grep -v "^$" | tail -5
done
if [ "${TESTS:-0}" = 1 ]; then
  with all timeout ${TTIMEOUT:-90} python3 -m pytest -q -m gpu tests/test_fp8_kernels.py -p no:cacheprovider 2>&1 | tail -3
fi
