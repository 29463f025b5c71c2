# Diffusion-Gemma 26B-A4B shapes (random bf16), canvas 256: denoise / commit ms with denoiser graphs off and on
# at batch 1/16/64, then tok/s in the engine at concurrency 1 and 16 (docs/benchmarks.md "Diffusion-Gemma").
timeout ${TIMEOUT:-400} python3 -m fluxlab.bench.canvas --graphs both --batch-sizes 1,16,64 --concurrency 1,16 \
  --steps 16 --prompt-tokens 256 --max-new-tokens 512 --repeats 3 --out $OUT/canvas.json > $OUT/canvas.log 2>&1; rc=$?
grep -E "Traceback|Error" $OUT/canvas.log | head -5
python3 -c "import json, sys; from fluxlab.bench.canvas import print_table; print_table(json.load(open(sys.argv[1])))" \
  $OUT/canvas.json 2>&1 | tail -20; exit $rc
