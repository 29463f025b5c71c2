# Persistent TMA GEMMs (kernels/tma.py, FLUXLAB_PERSISTENT) against per-tile ones: benchmarks/device/gemm_persistent.py
# (graph-replay ms and bits at the models' shapes, both ways at every row count; KINDS=fp8|bf16; PTIMEOUT bounds it;
# KERNELS=0 skips it). Then, unless E2E=0, end to end with FLUXLAB_PERSISTENT="" (per-tile) and the default, in
# the same call: Diffusion-Gemma's bf16 denoising step (DG_BATCHES, default 1,16; DG_QUANT=fp8 for FP8 weights) and
# LLaDA2.0-mini fp8 decode (roofline, b1 and b64; LLADA=0 skips it).
[ "${KERNELS:-1}" = 1 ] && timeout ${PTIMEOUT:-420} python3 benchmarks/device/gemm_persistent.py $OUT/gemm_persistent.json \
  2>&1 | grep -vi warn | tee $OUT/gemm_persistent.txt | tail -${PTAIL:-60}
[ "${E2E:-1}" = 1 ] || exit 0
for v in per_tile default; do
  env=(); [ "$v" = default ] || env=(FLUXLAB_PERSISTENT=)
  env "${env[@]}" timeout ${DG_TIMEOUT:-110} python3 -m fluxlab.bench.canvas --preset diffusion_gemma_26b_a4b \
    --quantization ${DG_QUANT:-none} --graphs on --batch-sizes ${DG_BATCHES:-1,16} --concurrency 1 --steps 16 \
    --prompt-tokens 256 --max-new-tokens 512 --repeats 3 --out $OUT/dg_${v}.json > $OUT/dg_${v}.log 2>&1
  echo "DG ${DG_QUANT:-none} $v exit $?"; grep -vi warn $OUT/dg_${v}.log | grep -v "^$" | tail -6
  [ "${LLADA:-1}" = 1 ] && env "${env[@]}" timeout 80 python3 -m fluxlab.bench.roofline --batch-sizes 1,64 \
    --variants triton+graph --quantization fp8 --out $OUT/roofline_${v}.json 2>&1 | grep -vi warn | tail -2
done
