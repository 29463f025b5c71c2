# Issue 36.3: Diffusion-Gemma's dense MLP on a second stream beside the router and routed experts
# (DiffusionGemmaModel.dense_beside_experts_; load_model turns it on up to 1024 tokens). TESTS=1 (default): the GPU test that tokens with
# the two streams equal one stream's at batch 1 and 8, graphs captured with the fork and join (PYTEST_K: pytest -k, default that test alone; PYTEST_K="batch or beside": the file). Then
# benchmarks/device/diffusion_gemma_overlap.py: one 26B-A4B build (QUANT: none | fp8), for each max-tokens value of
# VARIANTS (default 0,1024,4096; 0 = one stream, first) the denoising step at batch 1 and 16, served c1 at 16 steps,
# and 4 requests' tokens against the one-stream run. ~6-8 min: give it the whole call.
if [ "${TESTS:-1}" = 1 ]; then
  timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_diffusion_gemma_invariance.py -k "${PYTEST_K:-beside}" -p no:cacheprovider \
    > $OUT/pytest.log 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed|Error" $OUT/pytest.log | tail -6
fi
timeout ${TIMEOUT:-380} python3 benchmarks/device/diffusion_gemma_overlap.py $OUT/overlap_${QUANT:-none}.json \
  ${QUANT:-none} ${VARIANTS:-0,1024,4096} 2>&1 | grep -vi warn | tail -12
