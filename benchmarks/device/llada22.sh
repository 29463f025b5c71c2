# LLaDA2.2 block routing against LLaDA2.0 routing in one call (the same shapes), and the decode-step cost of
# each decoder on [rows, 32, 157184] logits (docs/benchmarks.md "LLaDA2.2"). VARIANTS (default triton+graph).
for p in llada2_mini llada22_mini; do
  timeout 200 python3 -m fluxlab.bench.roofline --preset $p --batch-sizes 1,16,64 --variants ${VARIANTS:-triton+graph} \
    --out $OUT/roofline_$p.json 2>&1 | grep -E "bs=|Error|Traceback" | cut -c1-200
done
timeout 120 python3 -m fluxlab.bench.decoder_step --rows 1,16,64 --out $OUT/decoder_step.json 2>&1 | grep -vi warn | tail -6
