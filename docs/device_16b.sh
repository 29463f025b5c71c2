#!/usr/bin/env bash
# Issue 16b on one H200 (torch 2.11 + triton 3.6; PYTHONPATH set by the caller), from the repo root,
# <= ~195 s. Three independent parts, each under its own timeout (SIGINT first: pytest and the bench
# still print what they finished):
#   1. the GPU tests of tests/test_fused_moe.py (align vs scan align, shrink vs full height, a
#      token's output vs the other tokens in its batch, graphs, bf16 vs moe_forward);
#   2. informational: does a token's output change with the batch size under the shipped table
#      (its BLOCK_M differs between token counts)?
#   3. the MoE layer, previous kernel vs new, 512-4096 tokens, CUDA-graph replay, floor beside each;
#      writes the table with the SHRINK picks to $OUT/NVIDIA_H200.json and prints the table last.
# Outputs under $OUT (or a temp dir): pytest.log, batch_size_bits.log, moe_old_vs_new.json/.log,
# NVIDIA_H200.json (copy it to fluxlab/kernels/moe_configs/ if its rows say so).
set -u
OUT=${OUT:-$(mktemp -d)}
export OUT PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

echo "== 1. GPU tests (timeout 70 s)"
timeout -s INT -k 5 70 python3 -m pytest -q -m gpu tests/test_fused_moe.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -25
echo "pytest exit ${PIPESTATUS[0]}"

echo "== 2. batch size vs bits under the shipped table (timeout 20 s)"
timeout 20 python3 - <<'EOF' 2>&1 | tee "$OUT/batch_size_bits.log"
import torch
from fluxlab.engine.layers.moe import route
from fluxlab.kernels.fused_moe import default_config, fused_moe
gen = torch.Generator(device="cuda").manual_seed(0)
bf, E, H, I = torch.bfloat16, 256, 2048, 512
wg = torch.randn(E, 2 * I, H, device="cuda", dtype=bf, generator=gen) * H ** -0.5
wd = torch.randn(E, H, I, device="cuda", dtype=bf, generator=gen) * I ** -0.5
gw = torch.randn(E, H, device="cuda", dtype=bf, generator=gen) * H ** -0.5
x = torch.randn(4096, H, device="cuda", dtype=bf, generator=gen)
idx, wts = route(x, gw, None, top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5)
outs = {t: fused_moe(x[:t], idx[:t], wts[:t], wg, wd) for t in (32, 512, 1024, 2048, 4096)}
for t, out in outs.items():
    cfg = default_config(t, 8, E, H, I, bf, x.device)
    same = torch.equal(out[:32], outs[4096][:32])
    diff = (out[:32].float() - outs[4096][:32].float()).abs().max().item()
    print(f"first 32 tokens in a batch of {t:4d} (BM {cfg.BLOCK_M}, shrink {cfg.SHRINK1}/{cfg.SHRINK2}) vs of 4096: "
          f"same bits {same}, max diff {diff:.2e}")
EOF

echo "== 3. MoE layer, previous kernel vs new (timeout 95 s; SIGINT keeps the rows done)"
timeout -s INT -k 5 95 python3 -m fluxlab.kernels.bench_moe --old-vs-new --tokens 2048,4096,1024,512 --iters 20 \
  --write-table "$OUT/NVIDIA_H200.json" 2>&1 | tee "$OUT/moe_old_vs_new.log" | tail -8
echo "bench exit ${PIPESTATUS[0]}; files in $OUT"
