# Prefix cache off/on (alternating) with 5-shot GSM8K prompts, LLaDA2.0-mini shapes, concurrency 16
# (docs/benchmarks.md "Prefix cache"). The 5 exemplars are the shipped sample's first 5 lines (worked
# solutions), the questions .whl/gsm8k.jsonl's first 200. POLICY (default dynamic).
G=$R/.whl/gsm8k.jsonl; [ -f $G ] || { echo "prefix_cache needs $G (cp ../shared/datasets/gsm8k.jsonl .whl/)"; exit 2; }
{ head -5 fluxlab/assets/gsm8k_sample.jsonl; head -200 $G; } > /tmp/fewshot.jsonl
timeout ${TIMEOUT:-400} python3 -m fluxlab bench -m bench=online model=llada2_mini model.load_format=random \
  workload=gsm8k_fewshot workload.path=/tmp/fewshot.jsonl workload.num_shots=5 workload.max_tokens=128 \
  workload.num_prompts=64 scheduler.enable_prefix_cache=false,true,false,true bench.max_concurrency=16 \
  scheduler=${POLICY:-dynamic} decoding.block_length=32 decoding.steps=8 model.max_model_len=2048 \
  scheduler.max_num_seqs=16 scheduler.max_scheduled_tokens=4096 attention.use_decode_cuda_graph=true \
  'attention.cuda_graph_capture_bs=[1,2,4,8,16]' tracking=none hydra.sweep.dir=$OUT/sweep > $OUT/bench.log 2>&1; rc=$?
grep -hE "Traceback|Error" $OUT/bench.log | head -5
python3 "$R/benchmarks/device/summary.py" $OUT/sweep/results.jsonl; exit $rc
