# Programmatic dependent launch (fluxlab/kernels/pdl.py: on by default in the graph runners' forwards of at most
# MAX_TOKENS tokens) against FLUXLAB_PDL=0, in one call. TESTS=1 (default) first runs tests/test_pdl.py's GPU test
# (bits with and without, eager inside a forward_of scope and from a graph). Then LLaDA2.0-mini's decode forward
# (LLADA_QUANT, default fp8) at batch 1 / 64 for each of RUNS, and Diffusion-Gemma's denoising step at DG_BATCHES
# (default 1) for each of DG_RUNS (default "off on"; "" skips). "on" is the default policy, so at batch 64 and at 16
# canvases (above MAX_TOKENS) on and off run the same launches.
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TTIMEOUT:-240} python3 -m pytest -q -m gpu -p no:cacheprovider -p no:warnings tests/test_pdl.py \
    > $OUT/gpu_tests_pdl.txt 2>&1; echo "test_pdl exit $?"; tail -2 $OUT/gpu_tests_pdl.txt
fi
with() { local v=$1; shift; if [ "$v" = on ]; then FLUXLAB_PDL=1 "$@"; else FLUXLAB_PDL=0 "$@"; fi; }
i=0
for v in ${RUNS-off on off on}; do
  i=$((i + 1)); echo "LLaDA2.0-mini ${LLADA_QUANT:-fp8}, run $i: PDL $v"
  with $v timeout 120 python3 -m fluxlab.bench.roofline --batch-sizes 1,64 --variants triton+graph \
    --quantization ${LLADA_QUANT:-fp8} --out $OUT/roofline_${i}_$v.json 2>&1 | grep -vi warn | tail -2
done
for v in ${DG_RUNS-off on}; do
  i=$((i + 1))
  with $v timeout ${DG_TIMEOUT:-150} python3 -m fluxlab.bench.canvas --preset diffusion_gemma_26b_a4b --graphs on \
    --batch-sizes ${DG_BATCHES:-1} --concurrency 1 --steps 16 --prompt-tokens 256 --max-new-tokens 512 --repeats 3 \
    --out $OUT/dg_${i}_$v.json > $OUT/dg_${i}_$v.log 2>&1
  echo "DG PDL $v exit $?"; grep -vi warn $OUT/dg_${i}_$v.log | grep -v "^$" | tail -5
done
