# LLaDA2.0-flash shapes (random bf16) under tensor + expert parallelism (docs/benchmarks.md "Multi-GPU"):
# PARALLEL=tp2_ep2 on nvidia-h200-x2 (default) or tp4_ep4 on nvidia-h200-x4. Served (online bench, concurrency
# 1, 4, 16 over 16 prompts), then the roofline at batch 1, 4, 16. A cold engine takes ~135 s to start (JIT).
P=${PARALLEL:-tp2_ep2}
timeout 330 python3 -m fluxlab bench -m bench=online bench.max_concurrency=1,4,16 workload.num_prompts=16 \
  model=llada2_flash model.load_format=random parallel=$P decoding.block_length=32 decoding.steps=8 \
  workload.max_tokens=256 tracking=none model.max_model_len=1024 scheduler.max_num_seqs=16 \
  scheduler.max_scheduled_tokens=2048 attention.use_decode_cuda_graph=true 'attention.cuda_graph_capture_bs=[1,2,4,8,16]' \
  hydra.sweep.dir=$OUT/sweep > $OUT/bench.log 2>&1
grep -hE "Traceback|Error" $OUT/bench.log | head -5; python3 "$R/benchmarks/device/summary.py" $OUT/sweep/results.jsonl
timeout 240 python3 -m fluxlab.bench.roofline --preset llada2_flash --parallel $P --variants ${VARIANTS:-flashinfer+graph} \
  --batch-sizes 1,4,16 --out $OUT/roofline.json 2>&1 | grep -E "bs=|ceilings|Error|Traceback" | cut -c1-200
