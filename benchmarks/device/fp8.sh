# FP8 (issue 38): the GPU tests of the FP8 kernels, then benchmarks/device/fp8_kernels.py (the block-scaled fused MoE
# and GEMM against bf16 under graph replay, LLaDA2.0-mini shapes, several tile configs). ROOF=1 also times the
# forward, fp8 against bf16 in one process (python -m fluxlab.bench.roofline, VARIANTS default triton+graph).
timeout 150 python3 -m pytest -q -m gpu tests/test_fp8_kernels.py -p no:cacheprovider > $OUT/pytest.log 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|Error" $OUT/pytest.log | tail -8
timeout 240 python3 benchmarks/device/fp8_kernels.py $OUT/fp8_kernels.json 2>&1 | grep -vi warn | tee $OUT/fp8_kernels.txt
