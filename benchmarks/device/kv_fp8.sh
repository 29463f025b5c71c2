# FP8 KV pages (issue 38, model.kv_cache_dtype=fp8_e4m3): the GPU tests of tests/test_kv_fp8.py (the Triton kernel on
# e4m3 pages against sdpa, the fused K/V write into FP8 pages, triton = sdpa tokens at fp32 and graphs = eager), then
# LLaDA2.0-mini's decode forward against the roofline with auto (bf16) pages and with e4m3 pages, the same variants
# and batches: VARIANTS (default triton+graph; FP8 pages are read by sdpa and triton only), BATCH_SIZES (default 1,64).
# Writes $OUT/pytest.log, $OUT/roofline_auto.json and $OUT/roofline_fp8_e4m3.json. The roofline's floors count a
# cached value at one byte for the fp8_e4m3 pages, two for auto.
timeout 150 python3 -m pytest -v --tb=short -m gpu tests/test_kv_fp8.py -p no:cacheprovider > $OUT/pytest.log 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|Error" $OUT/pytest.log | tail -8
for kv in auto fp8_e4m3; do
  timeout ${TIMEOUT:-200} python3 -m fluxlab.bench.roofline --batch-sizes ${BATCH_SIZES:-1,64} \
    --variants ${VARIANTS:-triton+graph} --kv-cache-dtype $kv --out $OUT/roofline_$kv.json 2>&1 \
    | grep -E "bs=|KV pages|^\||Error|Traceback" | cut -c1-260
done
