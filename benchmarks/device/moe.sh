# MoE layer (docs/benchmarks.md "Kernels"): Triton fused MoE against torch._grouped_mm with the floor beside
# each (mini and flash shapes); the shipped tile table's kernel against the previous one; the MoE block with the
# shared expert fused or on a side stream. TUNE=1 also re-tunes the tile table (moe_tune, ~100 s).
timeout 150 python3 -m fluxlab.bench.moe_layer 2>&1 | tee $OUT/bench_moe.txt | grep -vi warn | tail -12
timeout 120 python3 -m fluxlab.bench.moe_layer --old-vs-new --tokens 2048,4096,1024,512 --iters 20 2>&1 \
  | tee $OUT/old_vs_new.txt | grep -vi warn | tail -8
timeout 100 python3 benchmarks/device/moe_block.py 512,1024,2048,4096 2>&1 | tee $OUT/moe_block.txt | grep -vi warn | tail -10
if [ "${TUNE:-0}" = 1 ]; then
  timeout 150 python3 -m fluxlab.bench.moe_tune --tokens 2048,4096,1024,512,32 --budget-s 70 --out $OUT/moe_tune.json 2>&1 \
    | grep -E "^T=|^\||wrote|Error" | cut -c1-250
fi
