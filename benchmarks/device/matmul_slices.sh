# K-slices by weight shape for Diffusion-Gemma's bf16 matmuls (benchmarks/device/matmul_slices.py): the sweep (K=1),
# then the denoising step with the table it picks against none (D=1; RUNS, default "none sliced", may alternate
# more; DG_BATCHES, default 1,16). TABLE=file skips the sweep's pick and benches that table. TESTS=1 first runs
# the GPU tests of the matmul (the walk's kernels) and of the canvas attention (the eager path without fresh keys).
if [ "${TESTS:-0}" = 1 ]; then
  timeout ${TTIMEOUT:-240} python3 -m pytest -q -m gpu -p no:cacheprovider -p no:warnings tests/test_canvas_matmul.py \
    tests/test_canvas_attention.py > $OUT/gpu_tests.txt 2>&1
  echo "tests exit $?"; tail -3 $OUT/gpu_tests.txt
fi
if [ "${K:-1}" = 1 ]; then
  timeout ${KTIMEOUT:-300} python3 benchmarks/device/matmul_slices.py $OUT/matmul_slices.json 2>&1 | grep -vi warn \
    | tee $OUT/matmul_slices.txt | tail -${KTAIL:-30}
fi
table=${TABLE:-$OUT/table.json}
[ -n "$TABLE" ] || python3 -c "import json, sys; json.dump(json.load(open(sys.argv[1]))['table'], \
  open(sys.argv[2], 'w'))" $OUT/matmul_slices.json $table
echo "table: $(cat $table)"
echo '{}' > $OUT/none.json
if [ "${D:-1}" = 1 ]; then
  i=0
  for v in ${RUNS:-none sliced}; do
    i=$((i + 1)); t=$table; [ $v = none ] && t=$OUT/none.json
    timeout ${DG_TIMEOUT:-150} python3 benchmarks/device/matmul_slices.py --bench $t --preset diffusion_gemma_26b_a4b \
      --graphs on --batch-sizes ${DG_BATCHES:-1,16} --concurrency 1 --steps 16 --prompt-tokens 256 \
      --max-new-tokens 512 --repeats 3 --out $OUT/dg_${i}_$v.json > $OUT/dg_${i}_$v.log 2>&1
    echo "DG $v exit $?"; grep -vi warn $OUT/dg_${i}_$v.log | grep -v "^$" | tail -5
  done
fi
