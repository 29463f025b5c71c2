# Every GPU test (pytest -m gpu) but the soak; the server tests only when openai is importable (the image lacks it
# and .whl does not carry it unless added). FILES narrows it (e.g. FILES="tests/test_fused_moe.py").
ign=(); python3 -c "import openai" 2>/dev/null || ign=(--ignore tests/test_server.py --ignore tests/test_server_dp.py)
timeout ${TIMEOUT:-540} python3 -m pytest -v --tb=short -m gpu ${FILES:-tests} -p no:cacheprovider --deselect tests/test_soak.py \
  "${ign[@]}" > $OUT/pytest.log 2>&1; rc=$?
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.log | tail -15; exit $rc
