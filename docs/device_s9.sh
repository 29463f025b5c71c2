#!/bin/bash
# Session 9 device calls (docs/benchmarks.md §20), run from the repository root with carry [".whl", ".fi"]:
# .whl from ../shared/tools/device-wheels.sh --serve opentelemetry-api annotated-doc, .fi/gsm8k.jsonl from
# ../shared/datasets, .fi/pre = git archive 0916504 fluxlab conf hydra_plugins (without fluxlab/assets/arith_llada2).
# Calls B-D ran the GPU tests, the roofline alternating new/pre and the kernel profile; call D also the served bench.
source docs/device_lib.sh
el "gpu tests"
timeout 200 python3 -m pytest -q -m gpu tests/test_fused_norm.py tests/test_fused_moe.py tests/test_block_attention.py \
  tests/test_staging.py -p no:cacheprovider 2>&1 | grep -E "passed|failed|Error|assert" | tail -6
roofline_runs new1 pre1 new2
el "kernel profile"; timeout 120 python3 docs/device_kernel_profile.py 64 triton > $OUT/prof64.txt 2>&1
grep -A18 "== " $OUT/prof64.txt | grep -v "^  *[0-9.]* us" | head -44
[[ "$1" == served ]] && { served $PWD new paged,dynamic 16,64; served_summary new
  served $PWD/.fi/pre pre paged,dynamic 16; served_summary pre; }
el done
