"""The Diffusion-Gemma GPU bench script runs end to end (tiny checkpoint on CPU, --smoke)."""
import json

from fluxlab.bench.canvas import main


def test_canvas_bench_smoke_writes_every_number(tmp_path, one_thread):
    out = tmp_path / "canvas.json"
    main(["--smoke", "--batch-sizes", "1,2", "--concurrency", "2", "--prompt-tokens", "9", "--max-new-tokens", "16",
          "--repeats", "1", "--out", str(out)])  # --steps: 4 by default with --smoke (16 is above the tiny's ceiling)
    results = json.loads(out.read_text())["off"]  # --graphs off (the default)
    assert [r["batch"] for r in results["forwards"]] == [1, 2]
    assert all(r["denoise_ms"] > 0 and r["commit_ms"] > 0 for r in results["forwards"])
    served = results["served"][0]
    # a fixed step count and no early stop: every canvas takes 4 forwards for its 8 tokens
    assert served["output_tokens"] == 2 * 16 and served["tpf"] == 8 / 4


def test_canvas_bench_smoke_graphs_both(tmp_path, one_thread):
    """--graphs both: the eager half, then the static denoising path (called as is on CPU) for
    the denoising steps and the forward alone; the same served tokens either way."""
    out = tmp_path / "canvas.json"
    main(["--smoke", "--batch-sizes", "1,3", "--concurrency", "2", "--prompt-tokens", "9", "--max-new-tokens", "16",
          "--steps", "4", "--repeats", "1", "--graphs", "both", "--out", str(out)])
    results = json.loads(out.read_text())
    assert set(results) == {"off", "on"}
    assert [r["graphs"] for r in results["on"]["forwards"]] == [True, True]
    assert [r["commit_graphs"] for r in results["on"]["forwards"]] == [True, True]
    assert all(r["commit_denoise_ms"] > 0 for mode in results.values() for r in mode["forwards"])
    assert [r["graphs"] for r in results["off"]["forwards"]] == [False, False]
    assert all(r["denoise_forward_ms"] > 0 for r in results["on"]["forwards"])
    assert results["on"]["served"][0]["output_tokens"] == results["off"]["served"][0]["output_tokens"] == 2 * 16


def test_random_weights_build_the_preset_shapes(monkeypatch):
    """model.load_format=random: the 26B-A4B preset parses into transformers' config (25.2B
    parameters as published, per-layer KV shapes), and the builder fills a shrunken copy on the device."""
    import copy

    import torch

    from fluxlab.models.diffusion_gemma import presets as presets
    from fluxlab.models.diffusion_gemma.runner import kv_shapes
    from fluxlab.models.diffusion_gemma.model import DiffusionGemmaModel
    from fluxlab.models.diffusion_gemma.attention import CanvasSegment, DenseCanvasAttention, DenseKV

    text = presets.preset_text_config("diffusion_gemma_26b_a4b")
    assert text.layer_types.count("full_attention") == 5 and text.layer_types[-1] == "full_attention"
    assert set(kv_shapes(text)) == {(8, 256), (2, 512)}
    with torch.device("meta"):
        params = sum(p.numel() for p in DiffusionGemmaModel(text).parameters())
    assert 25.0e9 < params < 25.5e9  # SGLang cookbook / model card: 25.2B total
    small = copy.deepcopy(presets.DIFFUSION_GEMMA_26B_A4B)
    small["text_config"].update(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=6,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=32,
                                num_global_key_value_heads=1, num_experts=4, top_k_experts=2, moe_intermediate_size=16,
                                sliding_window=8)
    monkeypatch.setitem(presets.PRESETS, "small", small)
    model = presets.build_random_diffusion_gemma("small", torch.bfloat16, torch.device("cpu"))
    assert all(torch.isfinite(p.float()).all() for p in model.parameters())
    assert model.full_attention_inv_freq.dtype == torch.float32
    ids = torch.arange(12)
    attn = DenseCanvasAttention([CanvasSegment(DenseKV(), 12, True)], model.layer_is_sliding, model.sliding_window)
    hidden = model(ids, ids, attn, torch.zeros(12, dtype=torch.bool))
    assert hidden.dtype == torch.bfloat16 and torch.isfinite(model.compute_logits(hidden)).all()
