#!/bin/bash
# Session 9 device calls (docs/benchmarks.md §20), run from the repository root with carry [".whl", ".fi"]:
# .whl from ../shared/tools/device-wheels.sh --serve opentelemetry-api annotated-doc, .fi/gsm8k.jsonl from
# ../shared/datasets, .fi/pre = git archive 0916504 fluxlab conf hydra_plugins (without fluxlab/assets/arith_llada2).
# Calls B-D ran the GPU tests, the roofline alternating new/pre and the kernel profile; call D also the served bench.
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD; R=$PWD
cp -r fluxlab/assets/arith_llada2 .fi/pre/fluxlab/assets/ 2>/dev/null
el "gpu tests"
timeout 200 python3 -m pytest -q -m gpu tests/test_fused_norm.py tests/test_fused_moe.py tests/test_block_attention.py \
  tests/test_staging.py -p no:cacheprovider 2>&1 | grep -E "passed|failed|Error|assert" | tail -6
for run in new1 pre1 new2; do
  d=$PWD; [[ $run == pre* ]] && d=$PWD/.fi/pre
  el "$run"; (cd $d && PYTHONPATH=/tmp/site:$d timeout 90 python3 -m fluxlab.bench.roofline --batch-sizes 1,16,64 \
    --variants triton+graph --out $OUT/roof_$run.json 2>&1 | grep -E "bs=|Error|Traceback" | tail -3)
done
el "kernel profile"; timeout 120 python3 docs/device_kernel_profile.py 64 triton > $OUT/prof64.txt 2>&1
grep -A18 "== " $OUT/prof64.txt | grep -v "^  *[0-9.]* us" | head -44
G=$PWD/.fi/gsm8k.jsonl
served() {  # $1 tree $2 label $3 policies $4 concurrencies
  el "served $2"
  (cd $1 && PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m fluxlab bench -m bench=online attention=triton \
    scheduler=$3 bench.max_concurrency=$4 model=llada2_mini model.load_format=random decoding.block_length=32 \
    decoding.steps=8 scheduler.max_num_seqs=64 scheduler.max_scheduled_tokens=4096 attention.use_decode_cuda_graph=true \
    workload=gsm8k workload.path=$G workload.num_prompts=256 workload.max_tokens=256 model.max_model_len=1024 \
    tracking=none hydra.sweep.dir=$OUT/served_$2 > $OUT/served_$2.log 2>&1; echo "rc $?")
  python3 - $OUT/served_$2 <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).rglob("results.jsonl")):
    for line in f.read_text().splitlines():
        r = json.loads(line)
        print({k: (round(r[k], 2) if isinstance(r.get(k), float) else r.get(k)) for k in ("name", "output_throughput", "mean_step_ms", "mean_host_ms", "median_ttft_ms")})
PY
}
[[ "$1" == served ]] && { served $PWD new paged,dynamic 16,64; served $PWD/.fi/pre pre paged,dynamic 16; }
el done
