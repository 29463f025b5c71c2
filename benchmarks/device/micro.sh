# Per-call microseconds of the small kernels of a LLaDA2.0-mini layer under a CUDA graph (router top-k, MoE
# align, silu*up, QK-norm + RoPE + KV write, stacked GEMM, vocab stats), the block attention at 1/2/4 pages a
# softmax step, and programmatic dependent launch against plain launches (docs/benchmarks.md "Kernels").
timeout 150 python3 benchmarks/device/micro.py new > $OUT/micro.txt 2>&1; grep -vi warn $OUT/micro.txt | tail -40
timeout 90 python3 benchmarks/device/attention_pages.py new > $OUT/attention_pages.txt 2>&1; grep -E "^new|Error" $OUT/attention_pages.txt
timeout 120 python3 benchmarks/device/pdl.py > $OUT/pdl.txt 2>&1; tail -16 $OUT/pdl.txt
