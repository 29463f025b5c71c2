# LLaDA2.0-mini decode/commit forward against the roofline floors (docs/benchmarks.md "Forward vs roofline").
# VARIANTS (default triton+graph; also fa4+graph after the fa4 step, flashinfer+graph: ~70 s of JIT when cold),
# PRESET (default llada2_mini), BATCH_SIZES (default 1,16,64), BLOCK and STEPS (default 32 and 8; SDAR-8B:
# PRESET=sdar_8b BLOCK=4 STEPS=4, issue 41). Writes $OUT/roofline.json.
timeout ${TIMEOUT:-400} python3 -m fluxlab.bench.roofline --preset ${PRESET:-llada2_mini} \
  --batch-sizes ${BATCH_SIZES:-1,16,64} --block ${BLOCK:-32} --steps ${STEPS:-8} --variants ${VARIANTS:-triton+graph} --out $OUT/roofline.json 2>&1 \
  | grep -E "bs=|ceilings|^\||Error|Traceback" | cut -c1-260
