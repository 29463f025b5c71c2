# Persistent / warp-specialized TMA GEMMs (kernels/tma.py FLUXLAB_PERSISTENT) against the shipped TMA kernels:
# benchmarks/device/gemm_persistent.py (graph-replay ms and bits at the models' shapes; KINDS=fp8|bf16, PVARIANTS
# picks the variants, PTIMEOUT bounds it). Then, unless E2E=0, the variant with the fewest ms a step at every row
# count (same bits, >= 2% under the shipped TMA at one of them) of each kernel runs end to end against the default
# in the same call: Diffusion-Gemma's bf16 denoising step (DG_BATCHES, default 1,16) and LLaDA2.0-mini fp8 decode.
timeout ${PTIMEOUT:-420} python3 benchmarks/device/gemm_persistent.py $OUT/gemm_persistent.json 2>&1 \
  | grep -vi warn | tee $OUT/gemm_persistent.txt | tail -${PTAIL:-60}
[ "${E2E:-1}" = 1 ] || exit 0
pick=$(python3 - "$OUT/gemm_persistent.json" <<'PY'
import json, re, sys
res = json.load(open(sys.argv[1]))
chosen = []
for kind, kernel in (("bf16", "matmul"), ("fp8", "fp8_gemm")):
    steps = {}  # variant -> {(model, rows): ms}
    for key, v in res.items():
        m = re.match(rf"{kind} (\S+) gemms a step @(\d+) (.+)$", key)
        if m and v["same_bits"]:
            steps.setdefault(m[3], {})[(m[1], m[2])] = v["ms"]
    base = steps.get("tma", {})
    wins = [(sum(t.values()), name) for name, t in steps.items() if name != "tma" and base and t.keys() == base.keys()
            and all(t[r] <= base[r] for r in base) and any(t[r] < 0.98 * base[r] for r in base)]
    if wins:
        chosen.append(f"{kernel}={min(wins)[1].removeprefix('persistent ')}")
print(",".join(chosen))
PY
)
echo "FLUXLAB_PERSISTENT picked: '${pick}'"
[ -n "$pick" ] || exit 0
for v in default "$pick"; do
  env=(); [ "$v" = default ] || env=(FLUXLAB_PERSISTENT="$v")
  i=$((i + 1))
  env "${env[@]}" timeout ${DG_TIMEOUT:-110} python3 -m fluxlab.bench.canvas --preset diffusion_gemma_26b_a4b \
    --quantization none --graphs on --batch-sizes ${DG_BATCHES:-1,16} --concurrency 1 --steps 16 --prompt-tokens 256 \
    --max-new-tokens 512 --repeats 3 --out $OUT/dg_bf16_${i}.json > $OUT/dg_bf16_${i}.log 2>&1
  echo "DG bf16 run $i ($v) exit $?"; grep -vi warn $OUT/dg_bf16_${i}.log | grep -v "^$" | tail -3
  case "$v" in *fp8_gemm*|default)
    env "${env[@]}" timeout 80 python3 -m fluxlab.bench.roofline --batch-sizes 1,64 --variants triton+graph \
      --quantization fp8 --out $OUT/roofline_${i}.json 2>&1 | grep -vi warn | tail -2;;
  esac
done
