#!/bin/bash
# Session 11, FA4 on the final code: the second of two back-to-back calls on one warm nvidia-h200 (the first is
# `docs/device_s11.sh fa4a ...` with carry [".whl", ".fi", ".fa4a"]); this one carries [".fa4b"], the second part of
# nvidia-cutlass-dsl-libs-cu13 4.8.1 re-packed as tar.xz. Args: tests (FA4's GPU tests), then the roofline of
# --variants $VARIANTS (default fa4+graph) at --max-new-tokens $TOKENS (default 256).
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
[ -f /tmp/cu13.part00 ] && [ -d /tmp/site ] || { echo "the first call's /tmp is gone (a fresh machine)"; exit 3; }
cat /tmp/cu13.part00 .fa4b/cu13.part01 > /tmp/cu13.tar.xz
echo "15704df2cb0eba9448713c6171597f02e01d50601322333b39220608e0c60184  /tmp/cu13.tar.xz" | sha256sum -c || exit 1
tar xJf /tmp/cu13.tar.xz -C /tmp/fa4 || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/fa4/nvidia_cutlass_dsl/dsl_packages:/tmp/fa4:/tmp/site:$PWD
el installed; python3 -c "import flash_attn.cute; print('fa4 import ok')" 2>&1 | tail -1
if [[ " $* " == *" tests "* ]]; then
el "fa4 tests"
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -W ignore tests/test_attention_fa4.py \
  "tests/test_prefill_graphs.py::test_prefill_graphs_replay_prefill_forwards_with_the_eager_tokens[fa4]" \
  2>&1 | grep -E "passed|failed|Error|assert|skipped" | tail -10
fi
el "roofline ${VARIANTS:=fa4+graph}"
timeout 240 python3 -m fluxlab.bench.roofline --batch-sizes 1,16,64 --max-new-tokens ${TOKENS:-256} --variants $VARIANTS \
  --out $OUT/roof_fa4.json 2>&1 | grep -E "bs=|ceilings|^\||Error|Traceback" | cut -c1-260
el done
