"""The Diffusion-Gemma GPU bench script runs end to end (tiny checkpoint on CPU, --smoke)."""
import json

from fluxlab.bench.canvas import main


def test_canvas_bench_smoke_writes_every_number(tmp_path, one_thread):
    out = tmp_path / "canvas.json"
    main(["--smoke", "--batch-sizes", "1,2", "--concurrency", "2", "--prompt-tokens", "9", "--max-new-tokens", "16",
          "--steps", "4", "--repeats", "1", "--out", str(out)])
    results = json.loads(out.read_text())
    assert [r["batch"] for r in results["forwards"]] == [1, 2]
    assert all(r["denoise_ms"] > 0 and r["commit_ms"] > 0 for r in results["forwards"])
    served = results["served"][0]
    # a fixed step count and no early stop: every canvas takes 4 forwards for its 8 tokens
    assert served["output_tokens"] == 2 * 16 and served["tpf"] == 8 / 4
