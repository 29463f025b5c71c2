# FP8 TMA tiles and paired K-blocks (benchmarks/device/fp8_tma_pairs.py): the kernel sweep with its bit check,
# then the decode forward of LLaDA2.0-mini (fp8, b1/b64) and Diffusion-Gemma's fp8 denoising step at batch 1 with
# a served c1 stream, shipped kernels first, then with every switch on (FLUXLAB_FP8_GEMM, FLUXLAB_FP8_MOE_CONFIG),
# alternating; MODEL=0 skips the model runs, TESTS=1 adds the FP8 GPU tests with the switches on.
timeout ${KTIMEOUT:-220} python3 benchmarks/device/fp8_tma_pairs.py $OUT/fp8_tma_pairs.json 2>&1 | grep -vi warn \
  | tee $OUT/fp8_tma_pairs.txt | tail -48
ON_GEMM=${ON_GEMM:-'{"TMA":1,"PAIRS":1}'}; ON_MOE=${ON_MOE:-'{"TMA1":1,"TMA2":1,"PAIRS2":1}'}
if [ "${MODEL:-1}" = 1 ]; then
  for v in shipped on; do
    if [ $v = on ]; then export FLUXLAB_FP8_GEMM=$ON_GEMM FLUXLAB_FP8_MOE_CONFIG=$ON_MOE; fi
    timeout 100 python3 -m fluxlab.bench.roofline --batch-sizes 1,64 --variants triton+graph --quantization fp8 \
      --out $OUT/roofline_$v.json 2>&1 | grep -vi warn | tail -4
    timeout ${DG_TIMEOUT:-150} python3 -m fluxlab.bench.canvas --preset diffusion_gemma_26b_a4b --quantization fp8 \
      --graphs on --batch-sizes 1 --concurrency 1 --steps 16 --prompt-tokens 256 --max-new-tokens 512 --repeats 3 \
      --out $OUT/dg_$v.json > $OUT/dg_$v.log 2>&1
    echo "DG $v exit $?"; grep -vi warn $OUT/dg_$v.log | tail -6
  done
  unset FLUXLAB_FP8_GEMM FLUXLAB_FP8_MOE_CONFIG
fi
if [ "${TESTS:-0}" = 1 ]; then
  FLUXLAB_FP8_GEMM=$ON_GEMM FLUXLAB_FP8_MOE_CONFIG=$ON_MOE timeout 120 python3 -m pytest -q -m gpu \
    tests/test_fp8_kernels.py -p no:cacheprovider 2>&1 | tail -3
fi
