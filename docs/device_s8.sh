#!/bin/bash
# Session 8 device calls (docs/benchmarks.md §19), run from the repository root with carry [".whl", ".fi"]:
# .whl from ../shared/tools/device-wheels.sh --serve opentelemetry-api annotated-doc, .fi/gsm8k.jsonl from
# ../shared/datasets, .fi/pre = git archive 183131b fluxlab conf hydra_plugins (without fluxlab/assets/arith_llada2),
# .fi/timeline.py = docs/device_host_timeline.py.
source docs/device_lib.sh
# Calls A/B: where a steady step's host time goes (gaps between stamps), new and pre
tl() { (cd $1 && PYTHONPATH=/tmp/site:$1 timeout 100 python3 $R/.fi/timeline.py 64 paged triton 2>&1 | grep -v Warn | tail -14); }
el "timeline new"; tl $PWD
el "timeline pre"; tl $PWD/.fi/pre
# Calls B/C (and D with --batch-sizes 16,64, pre first): roofline new/pre alternating
roofline_runs new1 pre1 new2 pre2
el "gpu tests"
timeout 200 python3 -m pytest -q -x -m gpu tests/test_staging.py tests/test_block_attention.py -p no:cacheprovider 2>&1 | tail -3
# Calls D/E: served (E: paged,dynamic at 16 again, then the FlashInfer graph tests)
served $PWD new paged,dynamic 16,64
served $PWD/.fi/pre pre paged,dynamic 16
timeout 260 python3 -m pytest -q -x -m gpu tests/test_gpu.py tests/test_prefill_graphs.py -k "graph_replay or flashinfer" -p no:cacheprovider 2>&1 | tail -3
el done
