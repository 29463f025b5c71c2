# Host time per stage of steady engine steps, wall-clock wrappers, no profiler (docs/benchmarks.md "Host time"):
# FlashInfer's plan against the rest. CASES (default "1:paged 64:paged 16:dynamic 64:dynamic"), BACKEND
# (flashinfer). A process that captures new shapes compiles them first: keep >= 150 s a case when cold.
for c in ${CASES:-1:paged 64:paged 16:dynamic 64:dynamic}; do
  timeout 150 python3 benchmarks/device/host_stages.py ${c%%:*} ${c##*:} ${BACKEND:-flashinfer} 2>&1 | grep -vi warn | tail -12
done | tee $OUT/host_stages.txt
