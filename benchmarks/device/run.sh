#!/bin/bash
# Device driver: `bash benchmarks/device/run.sh STEP...` runs benchmarks/device/STEP.sh for each STEP, in order,
# from the repository root on the device machine (benchmarks/device/README.md). It installs the carried wheels
# of .whl/ into /tmp/site once, puts /tmp/site, FA4's /tmp/fa4 (when the fa4 step unpacked it) and the checkout
# on PYTHONPATH, and gives each step OUT=$OUT/STEP. A failing step is reported and the next one runs.
cd "$(dirname "$0")/../.." || exit 1
R=$PWD; DIR=$R/benchmarks/device
steps() { for f in "$DIR"/*.sh; do b=$(basename "$f" .sh); [ "$b" != run ] && printf '%s ' "$b"; done; echo; }
[ $# -gt 0 ] || { echo "usage: bash benchmarks/device/run.sh STEP...; steps: $(steps)"; exit 2; }
for s in "$@"; do [ -f "$DIR/$s.sh" ] || { echo "no step $s (benchmarks/device/$s.sh); steps: $(steps)"; exit 2; }; done
OUT=${OUT:-$(mktemp -d)}; T0=$(date +%s)
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -3
fi
fa4_path() { [ -d /tmp/fa4/flash_attn ] && printf '/tmp/fa4/nvidia_cutlass_dsl/dsl_packages:/tmp/fa4:'; }
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tail -1
git log --oneline -1 2>/dev/null
failed=()
for s in "$@"; do
  el "step $s"; mkdir -p "$OUT/$s"
  PYTHONPATH="$(fa4_path)/tmp/site:$R" OUT="$OUT/$s" R="$R" PYTHONUNBUFFERED=1 bash "$DIR/$s.sh"
  rc=$?; [ $rc -eq 0 ] || { failed+=("$s (rc $rc)"); el "step $s failed: rc $rc"; }
done
el "done${failed:+; failed: ${failed[*]}}"; [ ${#failed[@]} -eq 0 ]
