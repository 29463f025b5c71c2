#!/bin/bash
# Session 10 device calls (docs/benchmarks.md §21), run from the repository root with carry [".whl", ".fi"]:
# .whl from ../shared/tools/device-wheels.sh --serve opentelemetry-api annotated-doc, .fi/gsm8k.jsonl from
# ../shared/datasets, .fi/pre = git archive 5a85076 fluxlab conf hydra_plugins (without fluxlab/assets/arith_llada2).
# Args: any of tests moetests micro roof roofnew prof served (default: tests micro roof prof).
source docs/device_lib.sh
want() { [[ $# -eq 0 || " $STEPS " == *" $1 "* ]]; }
STEPS="${*:-tests micro roof prof}"
if want tests; then
  el "gpu tests"
  timeout 300 python3 -m pytest -q -m gpu tests/test_fused_norm.py tests/test_swiglu.py tests/test_block_attention.py \
    tests/test_fused_moe.py tests/test_staging.py tests/test_moe_block.py tests/test_vocab_stats.py \
    tests/test_canvas_stats.py -p no:cacheprovider 2>&1 | grep -E "passed|failed|Error|assert" | tail -8
fi
if want micro; then
  el "micro"; timeout 150 python3 docs/device_micro.py new 2>&1 | tail -50
  (cd .fi/pre && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 $R/docs/device_micro.py pre 2>&1 | tail -30)
fi
want roof && roofline_runs new1 pre1 new2
want roofnew && roofline_runs new1
if want moetests; then
  el "gpu moe tests"
  timeout 200 python3 -m pytest -q -m gpu tests/test_fused_moe.py tests/test_moe_block.py -p no:cacheprovider 2>&1 \
    | grep -E "passed|failed|Error|assert" | tail -6
fi
if want prof; then
  el "kernel profile"; timeout 120 python3 docs/device_kernel_profile.py 64 triton 30 > $OUT/prof64.txt 2>&1
  grep -v "^  *[0-9.]* us" $OUT/prof64.txt | grep -v Warn | head -44
fi
if want served; then
  served $PWD new paged,dynamic 16,64; served_summary new
  served $PWD/.fi/pre pre paged,dynamic 16,64; served_summary pre
fi
el done
