#!/bin/bash
# Session 8 device calls (docs/benchmarks.md §19), run from the repository root with carry [".whl", ".fi"]:
# .whl from ../shared/tools/device-wheels.sh --serve opentelemetry-api annotated-doc, .fi/gsm8k.jsonl from
# ../shared/datasets, .fi/pre = git archive 183131b fluxlab conf hydra_plugins (without fluxlab/assets/arith_llada2),
# .fi/timeline.py = docs/device_host_timeline.py.
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD; R=$PWD
cp -r fluxlab/assets/arith_llada2 .fi/pre/fluxlab/assets/ 2>/dev/null
# Calls A/B: where a steady step's host time goes (gaps between stamps), new and pre
tl() { (cd $1 && PYTHONPATH=/tmp/site:$1 timeout 100 python3 $R/.fi/timeline.py 64 paged triton 2>&1 | grep -v Warn | tail -14); }
el "timeline new"; tl $PWD
el "timeline pre"; tl $PWD/.fi/pre
# Calls B/C (and D with --batch-sizes 16,64, pre first): roofline new/pre alternating
for run in new1 pre1 new2 pre2; do
  d=$PWD; [[ $run == pre* ]] && d=$PWD/.fi/pre
  el "$run"; (cd $d && PYTHONPATH=/tmp/site:$d timeout 90 python3 -m fluxlab.bench.roofline --batch-sizes 1,16,64 \
    --variants triton+graph --out $OUT/roof_$run.json 2>&1 | grep -E "bs=|Error|Traceback" | tail -3)
done
el "gpu tests"
timeout 200 python3 -m pytest -q -x -m gpu tests/test_staging.py tests/test_block_attention.py -p no:cacheprovider 2>&1 | tail -3
# Calls D/E: served (E: paged,dynamic at 16 again, then the FlashInfer graph tests)
G=$PWD/.fi/gsm8k.jsonl
served() {  # $1 tree $2 label $3 policies $4 concurrencies
  el "served $2"
  (cd $1 && PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m fluxlab bench -m bench=online attention=triton \
    scheduler=$3 bench.max_concurrency=$4 model=llada2_mini model.load_format=random decoding.block_length=32 \
    decoding.steps=8 scheduler.max_num_seqs=64 scheduler.max_scheduled_tokens=4096 attention.use_decode_cuda_graph=true \
    workload=gsm8k workload.path=$G workload.num_prompts=256 workload.max_tokens=256 model.max_model_len=1024 \
    tracking=none hydra.sweep.dir=$OUT/served_$2 > $OUT/served_$2.log 2>&1; echo "rc $?")
}
served $PWD new paged,dynamic 16,64
served $PWD/.fi/pre pre paged,dynamic 16
timeout 260 python3 -m pytest -q -x -m gpu tests/test_gpu.py tests/test_prefill_graphs.py -k "graph_replay or flashinfer" -p no:cacheprovider 2>&1 | tail -3
el done
