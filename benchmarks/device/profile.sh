# GPU kernel time of a steady decode and commit step by kernel group, kernel count and the gaps between kernels
# (docs/benchmarks.md "Where a forward's GPU time goes"). BATCH_SIZES (default 1,16,64), BACKEND (triton),
# QUANT (none | fp8: model.quantization=fp8, issue 38's "why is fp8 slower than bf16 at batch 1").
# Do not time anything after it in the same process: the profiler slows later launches.
for bs in $(echo ${BATCH_SIZES:-1,16,64} | tr , " "); do
  timeout 150 python3 benchmarks/device/kernel_profile.py $bs ${BACKEND:-triton} 12 ${QUANT:-none} > $OUT/prof$bs.txt 2>&1
  grep -E "^==|^   [a-z]|Error|Traceback" $OUT/prof$bs.txt | head -24
done
