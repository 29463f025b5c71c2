# TMA tiles for the GEMM kernels under CUDA graphs (fluxlab/kernels/tma.py): the FP8 GEMM and the bf16 invariant
# matmul. TESTS=1 runs their GPU tests. KERNELS=1 runs benchmarks/device/gemm_tma.py (bits and graph-replay times
# against pointer loads and persistent launches; SWEEP=1 adds its tile sweep, KINDS=fp8|bf16 picks the kernels). Then,
# for each run (`pointers`: FLUXLAB_TMA=""; `per_tile`: FLUXLAB_PERSISTENT=""; `default`; `all`: both kernels' TMA
# tiles): LLaDA2.0-mini's fp8 decode forward at b1/b64 for each of LLADA_RUNS, and
# Diffusion-Gemma's denoising step at DG_BATCHES (default 1,16) with a served c1 stream for each of DG_RUNS, with
# DG_QUANT weights (none (bf16, the default) or fp8).
if [ "${TESTS:-0}" = 1 ]; then
  timeout ${TTIMEOUT:-180} python3 -m pytest -q -m gpu tests/test_fp8_kernels.py tests/test_canvas_matmul.py \
    -p no:cacheprovider 2>&1 | tail -4
fi
if [ "${KERNELS:-0}" = 1 ]; then
  timeout ${KTIMEOUT:-150} python3 benchmarks/device/gemm_tma.py $OUT/gemm_tma.json ${SWEEP:+--sweep} 2>&1 \
    | grep -vi warn | tee $OUT/gemm_tma.txt | tail -${KTAIL:-12}
fi
with() {  # with RUN CMD...: pointers (no TMA), per_tile (TMA, no persistent launch), default or all (both kernels)
  local v=$1; shift
  case $v in pointers) FLUXLAB_TMA="" "$@";; per_tile) FLUXLAB_PERSISTENT="" "$@";;
    all) FLUXLAB_TMA=fp8_gemm,matmul "$@";; *) "$@";; esac
}
i=0
for v in ${LLADA_RUNS-pointers default pointers default}; do  # LLADA_RUNS="" skips
  i=$((i + 1)); echo "LLaDA2.0-mini fp8, run $i: $v"
  with $v timeout 100 python3 -m fluxlab.bench.roofline --batch-sizes 1,64 --variants triton+graph --quantization fp8 \
    --out $OUT/roofline_${i}_$v.json 2>&1 | grep -vi warn | tail -2
done
q=${DG_QUANT:-none}
for v in ${DG_RUNS-pointers all}; do  # DG_RUNS="" skips
  i=$((i + 1))
  with $v timeout ${DG_TIMEOUT:-150} python3 -m fluxlab.bench.canvas --preset diffusion_gemma_26b_a4b --quantization $q \
    --graphs on --batch-sizes ${DG_BATCHES:-1,16} --concurrency 1 --steps 16 --prompt-tokens 256 --max-new-tokens 512 \
    --repeats 3 --out $OUT/dg_${q}_${i}_$v.json > $OUT/dg_${q}_${i}_$v.log 2>&1
  echo "DG $q $v exit $?"; grep -vi warn $OUT/dg_${q}_${i}_$v.log | grep -v "^$" | tail -6
done
