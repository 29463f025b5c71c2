#!/bin/bash
# Session 7 device calls (docs/benchmarks.md §18), run from the repository root with carry [".whl", ".fi"]:
# .whl from ../shared/tools/device-wheels.sh --serve opentelemetry-api annotated-doc (fastapi 0.165 needs both),
# .fi/pre = git archive 543ded8 fluxlab conf hydra_plugins (without fluxlab/assets/arith_llada2), .fi/gsm8k.jsonl.
# Call A = the first half plus roofline new/pre twice; B = roofline new/pre; D = the first half; C = the served
# half at the end (a separate call: one call runs 10 minutes at most).
T0=$(date +%s)
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
cp -r fluxlab/assets/arith_llada2 .fi/pre/fluxlab/assets/
el "tests triton/staging"
timeout 150 python3 -m pytest -q -x -m gpu tests/test_staging.py tests/test_block_attention.py -p no:cacheprovider 2>&1 | tail -2
el "stages"
timeout 80 python3 docs/device_host_stages.py 64 paged triton 2>&1 | tail -12
el "roofline new4"
timeout 100 python3 -m fluxlab.bench.roofline --batch-sizes 1,16,64 --variants triton+graph --out $OUT/roof_new4.json 2>&1 | grep -E "bs=|Error" | tail -3
el "roofline pre4"
(cd .fi/pre && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m fluxlab.bench.roofline --batch-sizes 1,16,64 --variants triton+graph --out $OUT/roof_pre4.json 2>&1 | grep -E "bs=|Error" | tail -3)
el "tests flashinfer graphs (JIT)"
timeout 240 python3 -m pytest -q -x -m gpu tests/test_gpu.py tests/test_prefill_graphs.py -k "graph_replay or flashinfer" -p no:cacheprovider 2>&1 | tail -3
el done

# Call C: served, new then pre
G=$PWD/.fi/gsm8k.jsonl
served() {  # $1 tree $2 label $3 policies $4 concurrencies
  el "served $2"
  (cd $1 && PYTHONPATH=/tmp/site:$PWD timeout 330 python3 -m fluxlab bench -m bench=online attention=triton \
    scheduler=$3 bench.max_concurrency=$4 model=llada2_mini model.load_format=random decoding.block_length=32 \
    decoding.steps=8 scheduler.max_num_seqs=64 scheduler.max_scheduled_tokens=4096 attention.use_decode_cuda_graph=true \
    workload=gsm8k workload.path=$G workload.num_prompts=256 workload.max_tokens=256 model.max_model_len=1024 \
    tracking=none hydra.sweep.dir=$OUT/served_$2 > $OUT/served_$2.log 2>&1; echo "rc $?")
}
served $PWD new paged,dynamic 16,64
served $PWD/.fi/pre pre paged,dynamic 16

# Calls E and F (final main, after the review cleanups): the GPU tests above, then batch 16/64 new/pre alternating
# for run in new6 pre6 new7 pre7; do d=$PWD; [[ $run == pre* ]] && d=$PWD/.fi/pre
#   (cd $d && PYTHONPATH=/tmp/site:$d python3 -m fluxlab.bench.roofline --batch-sizes 16,64 --variants triton+graph \
#      --out $OUT/roof_$run.json); done
