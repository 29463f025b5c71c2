# Served LLaDA2.0-mini shapes: `fluxlab serve` + the online bench, 256 GSM8K prompts, paged and dynamic at
# concurrency 16 and 64 (docs/benchmarks.md "Served throughput"). Needs .whl/gsm8k.jsonl (a copy of
# ../shared/datasets/gsm8k.jsonl). ATTENTION (default triton), POLICIES (paged,dynamic), CONCURRENCY (16,64).
G=$R/.whl/gsm8k.jsonl; [ -f $G ] || { echo "served needs $G (cp ../shared/datasets/gsm8k.jsonl .whl/)"; exit 2; }
timeout ${TIMEOUT:-500} python3 -m fluxlab bench -m bench=online attention=${ATTENTION:-triton} \
  scheduler=${POLICIES:-paged,dynamic} bench.max_concurrency=${CONCURRENCY:-16,64} model=llada2_mini \
  model.load_format=random decoding.block_length=32 decoding.steps=8 scheduler.max_num_seqs=64 \
  scheduler.max_scheduled_tokens=4096 attention.use_decode_cuda_graph=true workload=gsm8k workload.path=$G \
  workload.num_prompts=256 workload.max_tokens=256 model.max_model_len=1024 tracking=none \
  hydra.sweep.dir=$OUT/sweep > $OUT/bench.log 2>&1; rc=$?
grep -hE "Traceback|Error" $OUT/bench.log | head -5
python3 "$R/benchmarks/device/summary.py" $OUT/sweep/results.jsonl; exit $rc
