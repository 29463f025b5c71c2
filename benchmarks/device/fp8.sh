# FP8 (issue 38): the GPU tests of the FP8 kernels and of Diffusion-Gemma's FP8 model (TESTS=0 skips them);
# KERNELS=1 benchmarks/device/fp8_kernels.py (the block-scaled fused MoE and GEMM against bf16 under graph replay,
# LLaDA2.0-mini shapes, several tile configs); ROOF=1 the decode forward of LLaDA2.0-mini, bf16 then fp8
# (model.quantization=fp8, quantized at load), BATCH_SIZES (default 1,64); DG=1 the Diffusion-Gemma 26B-A4B preset
# (random weights) through python -m fluxlab.bench.canvas, bf16 then fp8 quantized at load, CUDA graphs on: the
# denoising step at batch 1 and 16 (denoise ms, forward ms) and one served stream; $OUT/dg_canvas_{none,fp8}.json.
# DG=1 TESTS=0 fits one 600 s call (two 26B builds, graph capture at 1 and 16 rows).
if [ "${TESTS:-1}" = 1 ]; then
  timeout 240 python3 -m pytest -q -m gpu tests/test_fp8_kernels.py tests/test_fp8_diffusion_gemma_exact.py tests/test_fp8_fused_projections.py \
    -p no:cacheprovider > $OUT/pytest.log 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed|Error" $OUT/pytest.log | tail -8
fi
if [ "${KERNELS:-0}" = 1 ]; then
  timeout ${KTIMEOUT:-240} python3 benchmarks/device/fp8_kernels.py $OUT/fp8_kernels.json 2>&1 | grep -vi warn | tee $OUT/fp8_kernels.txt
fi
if [ "${ROOF:-0}" = 1 ]; then
  for q in none fp8; do
    timeout 200 python3 -m fluxlab.bench.roofline --batch-sizes ${BATCH_SIZES:-1,64} --variants triton+graph \
      --quantization $q --out $OUT/roofline_$q.json 2>&1 | grep -vi warn | tail -12
  done
fi
if [ "${DG:-0}" = 1 ]; then
  for q in ${DG_QUANT:-none fp8}; do  # DG_QUANT=fp8: the bf16 run comes from another step of the same call
    timeout ${DG_TIMEOUT:-270} python3 -m fluxlab.bench.canvas --preset diffusion_gemma_26b_a4b --quantization $q \
      --graphs on --batch-sizes 1,16 --concurrency 1 --steps 16 --prompt-tokens 256 --max-new-tokens 512 --repeats 5 \
      --out $OUT/dg_canvas_$q.json > $OUT/dg_canvas_$q.log 2>&1
    echo "DG quantization=$q exit $?"; grep -E "Traceback|Error" $OUT/dg_canvas_$q.log | head -5
    grep -vi warn $OUT/dg_canvas_$q.log | tail -9
  done
fi
