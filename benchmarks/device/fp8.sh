# FP8 (issue 38): the GPU tests of the FP8 kernels; KERNELS=1 benchmarks/device/fp8_kernels.py (the block-scaled fused
# MoE and GEMM against bf16 under graph replay, LLaDA2.0-mini shapes, several tile configs); ROOF=1 the decode forward
# of LLaDA2.0-mini, bf16 then fp8 (model.quantization=fp8, quantized at load), BATCH_SIZES (default 1,64).
timeout 150 python3 -m pytest -q -m gpu tests/test_fp8_kernels.py -p no:cacheprovider > $OUT/pytest.log 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|Error" $OUT/pytest.log | tail -8
if [ "${KERNELS:-0}" = 1 ]; then
  timeout 240 python3 benchmarks/device/fp8_kernels.py $OUT/fp8_kernels.json 2>&1 | grep -vi warn | tee $OUT/fp8_kernels.txt
fi
if [ "${ROOF:-0}" = 1 ]; then
  for q in none fp8; do
    timeout 200 python3 -m fluxlab.bench.roofline --batch-sizes ${BATCH_SIZES:-1,64} --variants triton+graph \
      --quantization $q --out $OUT/roofline_$q.json 2>&1 | grep -vi warn | tail -12
  done
fi
