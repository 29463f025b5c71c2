#!/bin/bash
# Diffusion-Gemma's kernels against their floors on one GPU (issue 36.3), from the repo root with carry [".whl"]:
#   OUT=$OUT bash benchmarks/device/run.sh dg_probe         (STEPS= any of S A M G T N, in that order; default all)
# S: the sampler's statistics kernels, this tree and BASE (a `git archive` of another commit's fluxlab/, if given);
# A: the canvas attention kernel's tile configs as graph replays, b1 / b16 (dg_kernel_probe.py attention), this
#    tree's kernel and each of A_TREES's (directories holding another commit's fluxlab/, carried);
# M: the fused MoE's per-stage tiles at one canvas, bits checked (dg_kernel_probe.py moe_sweep);
# G: the fused MoE's stages against torch._grouped_mm at 256 / 4096 tokens (dg_kernel_probe.py moe);
# T: GPU tests of the kernels this probe touches (TESTS_FILES to change them);
# N: Nsight Compute on one warm call each of the canvas attention (sliding, full), the MoE and the sampler's
#    statistics at 16 canvases (NCU_KERNELS to narrow), SpeedOfLight / occupancy / warp stalls / pipes.
OUT=${OUT:-/tmp/out_dg_probe}; mkdir -p "$OUT"
STEPS=${STEPS:-SAMGTN}
P=$PWD/benchmarks/device/dg_kernel_probe.py
t() { echo "[t+${SECONDS}s] $*"; }
if [[ $STEPS == *S* ]]; then
  t "S: sampler statistics"
  for tree in ${BASE:+$BASE} . ${BASE:+$BASE}; do
    echo "tree $tree"; (cd "$tree" && PYTHONPATH=$PWD:$PYTHONPATH timeout 90 python3 $P stats 2>&1 | tail -2)
  done
fi
if [[ $STEPS == *A* ]]; then
  for tree in . $A_TREES; do  # A_TREES: other trees' kernels (a `git archive BRANCH fluxlab` each), same candidates
    name=$(basename $(cd $tree && pwd)); t "A: attention configs, tree $tree"
    (cd $tree && PYTHONPATH=$PWD:$PYTHONPATH timeout 150 python3 $P attention "$OUT/attention_$name.json" 2>&1 |
      tail -40)
  done
fi
if [[ $STEPS == *M* ]]; then
  t "M: moe stage tiles at one canvas"; timeout 120 python3 $P moe_sweep 2>&1 | tail -40
fi
if [[ $STEPS == *G* ]]; then
  t "G: moe vs grouped_mm"; timeout 120 python3 $P moe "$OUT/moe.json" 2>&1 | tail -8
fi
if [[ $STEPS == *T* ]]; then
  t "T: gpu tests"
  timeout ${T_TIMEOUT:-240} python3 -m pytest -m gpu -q -p no:cacheprovider -p no:warnings ${TESTS_FILES:-tests/test_fp8_kernels.py \
    tests/test_canvas_matmul.py tests/test_tma.py tests/test_gpu_diffusion_gemma_invariance.py tests/test_canvas_attention.py} \
    > "$OUT/gpu_tests.log" 2>&1
  echo "T exit $?"; grep -E "^(FAILED|ERROR)|^E |passed|failed|error" "$OUT/gpu_tests.log" | cut -c1-240 | tail -15
fi
if [[ $STEPS == *N* ]]; then
  SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis"
  for pair in ${NCU_KERNELS:-attention_sliding:_canvas_attention_kernel attention_full:_canvas_attention_kernel moe:_gate_up_kernel moe:_down_kernel stats:_max_kernel stats:_probs_kernel}; do
    what=${pair%%:*}; kernel=${pair##*:}
    t "N: ncu $what $kernel"
    timeout 100 ncu --clock-control none -k regex:$kernel --launch-skip 2 --launch-count 1 $SECTIONS \
      python3 $P once $what 16 > "$OUT/ncu_${what}_${kernel}.txt" 2>&1
    echo "ncu exit $?"
    grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Cache Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Shared Memory Configuration Size|Block Limit|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|One or More Eligible|No Eligible|Stall|Pipe|==PROF==|rror" \
      "$OUT/ncu_${what}_${kernel}.txt" | grep -v "^ *-" | cut -c1-150 | head -40
  done
fi
t done
