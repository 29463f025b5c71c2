#!/bin/bash
# Session 11 device calls (docs/benchmarks.md §22), run from the repository root with carry [".whl", ".fi"]:
# .whl from ../shared/tools/device-wheels.sh --serve opentelemetry-api annotated-doc, .fi/gsm8k.jsonl from
# ../shared/datasets, .fi/pre = git archive 9961016 fluxlab conf hydra_plugins (without fluxlab/assets/arith_llada2).
# Args: any of fa4a tests gputests pdl prof roof roofnew roof128 attn served (default: tests pdl prof).
# attn: block attention's pages per softmax step: micro new/pre, its GPU tests, the roofline at 1, 2 and 4.
# fa4a: the first call of docs/device_s11_fa4.sh's pair (carry .fa4a too): FA4's small wheels unzipped into
# /tmp/fa4 and the first part of its cu13 libs (re-packed as tar.xz, split in two) copied to /tmp.
source docs/device_lib.sh
want() { [[ $# -eq 0 || " $STEPS " == *" $1 "* ]]; }
STEPS="${*:-tests pdl prof}"
if want fa4a; then
  el "fa4 part one"; mkdir -p /tmp/fa4
  for w in .fa4a/*.whl; do python3 -m zipfile -e $w /tmp/fa4; done  # one tree: the wheels share nvidia_cutlass_dsl/
  cp .fa4a/cu13.part00 /tmp/ && ls /tmp/fa4 | tr '\n' ' '; echo
fi
if want tests; then
  el "gpu tests"
  timeout 300 python3 -m pytest -q -m gpu tests/test_fused_norm.py tests/test_swiglu.py tests/test_block_attention.py \
    tests/test_fused_moe.py tests/test_staging.py tests/test_moe_block.py tests/test_vocab_stats.py \
    tests/test_canvas_stats.py -p no:cacheprovider 2>&1 | grep -E "passed|failed|Error|assert" | tail -8
fi
if want gputests; then  # every other GPU test file
  el "other gpu tests"
  # (the server tests need openai, which the image lacks and .whl does not carry)
  timeout 400 python3 -m pytest -q -m gpu tests -p no:cacheprovider --deselect tests/test_soak.py \
    --ignore tests/test_server.py --ignore tests/test_server_dp.py \
    --ignore tests/test_fused_norm.py --ignore tests/test_swiglu.py --ignore tests/test_block_attention.py \
    --ignore tests/test_fused_moe.py --ignore tests/test_staging.py --ignore tests/test_moe_block.py \
    --ignore tests/test_vocab_stats.py --ignore tests/test_canvas_stats.py 2>&1 | grep -E "passed|failed|Error|assert" | tail -8
fi
if want pdl; then el "pdl micro"; timeout 120 python3 docs/device_pdl.py 2>&1 | tail -16; fi
if want prof; then
  for bs in 1 16 64; do
    el "kernel profile bs $bs"; timeout 120 python3 docs/device_kernel_profile.py $bs triton 12 > $OUT/prof$bs.txt 2>&1
    grep -E "^==|^   [a-z]" $OUT/prof$bs.txt | head -20
  done
fi
want roof && roofline_runs new1 pre1 new2
want roofnew && roofline_runs new1
if want roof128; then
  el "roofline 128 tokens"; timeout 90 python3 -m fluxlab.bench.roofline --batch-sizes 1,16,64 --max-new-tokens 128 \
    --variants triton+graph --out $OUT/roof_new128.json 2>&1 | grep -E "bs=|Error|Traceback" | cut -c1-200 | tail -3
fi
if want attn; then
  el "attention micro"; timeout 60 python3 docs/device_attention_pages.py new 2>&1 | grep -E "^new|Error" | tail -16
  (cd .fi/pre && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 $R/docs/device_attention_pages.py pre 2>&1 | grep -E "^pre|Error")
  el "block attention gpu tests"
  timeout 120 python3 -m pytest -q -m gpu tests/test_block_attention.py -p no:cacheprovider 2>&1 | grep -E "passed|failed|Error" | tail -3
  for n in 1 2 4; do
    el "roofline pages_per_step $n"
    timeout 90 python3 -c "import runpy, sys; import fluxlab.kernels.block_attention as b; b.PAGES_PER_STEP = $n
sys.argv = ['roofline', '--batch-sizes', '1,16,64', '--variants', 'triton+graph', '--out', '$OUT/roof_pages$n.json']
runpy.run_module('fluxlab.bench.roofline', run_name='__main__')" 2>&1 | grep -E "bs=|Error|Traceback" | cut -c1-150 | tail -3
  done
fi
if want served; then
  served $PWD new paged,dynamic 16,64; served_summary new
  served $PWD/.fi/pre pre paged,dynamic 16,64; served_summary pre
fi
el done
