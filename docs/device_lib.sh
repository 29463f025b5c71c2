# Shared set-up and steps of the session device scripts (docs/device_s8.sh, docs/device_s9.sh); sourced from the
# repository root on the device with carry [".whl", ".fi"]. `.fi/pre` holds the baseline tree (git archive of
# fluxlab conf hydra_plugins), `.fi/gsm8k.jsonl` the served workload.
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD; R=$PWD
cp -r fluxlab/assets/arith_llada2 .fi/pre/fluxlab/assets/ 2>/dev/null

roofline_runs() {  # labels new1 pre1 ...: the roofline from this tree (new*) or .fi/pre (pre*), in that order
  local run d
  for run in "$@"; do
    d=$R; [[ $run == pre* ]] && d=$R/.fi/pre
    el "$run"; (cd $d && PYTHONPATH=/tmp/site:$d timeout 90 python3 -m fluxlab.bench.roofline --batch-sizes 1,16,64 \
      --variants triton+graph --out $OUT/roof_$run.json 2>&1 | grep -E "bs=|Error|Traceback" | tail -3)
  done
}

served() {  # $1 tree $2 label $3 policies $4 concurrencies: §16's served bench, results under $OUT/served_$2
  el "served $2"
  (cd $1 && PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m fluxlab bench -m bench=online attention=triton \
    scheduler=$3 bench.max_concurrency=$4 model=llada2_mini model.load_format=random decoding.block_length=32 \
    decoding.steps=8 scheduler.max_num_seqs=64 scheduler.max_scheduled_tokens=4096 attention.use_decode_cuda_graph=true \
    workload=gsm8k workload.path=$R/.fi/gsm8k.jsonl workload.num_prompts=256 workload.max_tokens=256 \
    model.max_model_len=1024 tracking=none hydra.sweep.dir=$OUT/served_$2 > $OUT/served_$2.log 2>&1; echo "rc $?")
}

served_summary() {  # $1 label: one line per job of served $1
  python3 - $OUT/served_$1 <<'PY'
import json, pathlib, sys
for line in (pathlib.Path(sys.argv[1]) / "results.jsonl").read_text().splitlines():
    r = json.loads(line)
    print({k: (round(r[k], 2) if isinstance(r.get(k), float) else r.get(k))
           for k in ("name", "output_throughput", "mean_step_ms", "mean_host_ms", "median_ttft_ms")})
PY
}
