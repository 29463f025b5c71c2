# TTFT of 16 GSM8K prompts at once and of 4 prompts of 2048 tokens, triton against FlashInfer, prefill graphs
# off and on (docs/benchmarks.md "TTFT"). FlashInfer's first graph capture JIT-compiles (~70 s cold).
timeout 250 python3 -m fluxlab.bench.roofline --batch-sizes 16 --variants "" --concurrency 16 \
  --ttft-variants triton+graph,flashinfer+graph,triton+graph+prefill,flashinfer+graph+prefill \
  --out $OUT/ttft_c16.json 2>&1 | grep -E "TTFT|^\||Error|Traceback" | cut -c1-260
timeout 200 python3 -m fluxlab.bench.roofline --batch-sizes 4 --variants "" --concurrency 4 --ttft-prompt-tokens 2048 \
  --ttft-variants triton+graph,flashinfer+graph --out $OUT/ttft_2048.json 2>&1 | grep -E "TTFT|^\||Error|Traceback" | cut -c1-260
