# FP8 accuracy through the GPU kernels (issue 38 item 3): `python -m fluxlab bench sweep=fp8` on the embedded model's
# 128 held-out problems, engine on CUDA (bf16 weights, then the same quantized at load), tracking.backend=none (the
# device image has no mlflow), then right answers per job and token agreement with job 0 by fluxlab.bench.compare,
# the definitions the report uses. SWEEP=kv_fp8 does the FP8 KV pages instead. Needs .whl built with --serve (hydra).
# Writes $OUT/sweep (results.jsonl, each job's requests.csv).
export FLUXLAB_CACHE=${FLUXLAB_CACHE:-/tmp/flcache}
SWEEP=${SWEEP:-fp8}
timeout ${TIMEOUT:-300} python3 -m fluxlab bench sweep=$SWEEP tracking.backend=none bench.disable_progress=true \
  hydra.sweep.dir=$OUT/sweep ${ARGS:-} > $OUT/bench.log 2>&1; rc=$?
grep -E "Traceback|Error" $OUT/bench.log | head -5
python3 benchmarks/device/sweep_agreement.py $OUT/sweep
exit $rc
