"""Diffusion-Gemma groundwork: fluxlab's model vs transformers' on the tiny checkpoint (CPU, fp32)."""
import json

import pytest
import torch

from fluxlab.checkpoint import write_checkpoint
from fluxlab.models.diffusion_gemma.checkpoint import CANVAS_LENGTH, SLIDING_WINDOW
from fluxlab.models.diffusion_gemma.loader import load_diffusion_gemma, read_text_config
from fluxlab.models.diffusion_gemma.model import DiffusionGemmaModel
from fluxlab.models.diffusion_gemma.attention import CanvasSegment, DenseCanvasAttention, DenseKV

TOL = 2e-5  # fp32 rounding; a wrong mask, norm or RoPE dim moves these by >1e-3 (see the window test)


def err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference relative to the reference's scale (the tiny checkpoint's logits reach ~10)."""
    return ((ours - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint("tiny_diffusion_gemma", tmp_path_factory.mktemp("dg") / "tiny_dg", seed=0)


@pytest.fixture(scope="module")
def ref(ckpt):
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(str(ckpt), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(ckpt):
    return load_diffusion_gemma(ckpt, torch.float32, "cpu")


def _ids(n, vocab, seed):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _ref_cache(ref, prompt):
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=ref.config.text_config)
    hidden = ref.model.encoder(input_ids=prompt[None], cache=cache).last_hidden_state[0]
    return cache, hidden


def _encode(ours, kv, ids, start):
    attn = DenseCanvasAttention([CanvasSegment(kv, len(ids), True)], ours.layer_is_sliding, ours.sliding_window)
    return ours.encode(ids, torch.arange(start, start + len(ids)), attn)


def _denoise(ours, kv, canvas, start, sc_logits=None):
    attn = DenseCanvasAttention([CanvasSegment(kv, len(canvas), False)], ours.layer_is_sliding, ours.sliding_window)
    return ours.compute_logits(ours.denoise(canvas, torch.arange(start, start + len(canvas)), attn, sc_logits))


def test_checkpoint_is_transformers_layout(ckpt, ref):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "diffusion_gemma" and cfg["architectures"] == ["DiffusionGemmaForBlockDiffusion"]
    text = cfg["text_config"]
    assert text.get("use_bidirectional_attention") is None
    assert text["sliding_window"] == SLIDING_WINDOW and cfg["canvas_length"] == CANVAS_LENGTH
    assert set(text["layer_types"]) == {"sliding_attention", "full_attention"}
    assert {int(k) for k in text["per_layer_config"]} == {1, 3}  # full layers: own head_dim / KV heads
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    assert len(tok) == text["vocab_size"]
    assert tok.convert_ids_to_tokens([text["eos_token_id"]]) == ["<|endoftext|>"]
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == text["eos_token_id"] and gen["max_denoising_steps"] > 0


def test_checkpoint_round_trips_through_both_loaders(ckpt, ref, ours):
    from safetensors.torch import load_file

    stored = load_file(str(ckpt / "model.safetensors"))
    emb = stored["model.decoder.embed_tokens.weight"]
    assert torch.equal(ours.embed_tokens.weight, emb)
    assert torch.equal(ref.model.decoder.embed_tokens.weight, emb)
    assert torch.equal(ref.lm_head.weight, emb)  # tied head, as ours
    ref_layer, our_layer = ref.model.decoder.layers[1], ours.layers[1]
    assert torch.equal(our_layer.experts.gate_up_proj, ref_layer.experts.gate_up_proj)
    assert torch.equal(our_layer.self_attn.k_proj.weight, ref_layer.self_attn.k_proj.weight)
    assert our_layer.self_attn.v_proj is None and ref_layer.self_attn.v_proj is None  # full layers: k_eq_v


def test_checkpoint_is_deterministic(ckpt, tmp_path):
    again = write_checkpoint("tiny_diffusion_gemma", tmp_path / "again", seed=0)
    from safetensors.torch import load_file

    a, b = load_file(str(ckpt / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@torch.no_grad()
def test_encoder_pass_matches_transformers(ref, ours):
    vocab = ours.embed_tokens.num_embeddings
    for n in [3, SLIDING_WINDOW, 2 * SLIDING_WINDOW + 5]:
        prompt = _ids(n, vocab, seed=n)
        _, ref_hidden = _ref_cache(ref, prompt)
        hidden = _encode(ours, DenseKV(), prompt, 0)
        assert err(hidden, ref_hidden) < TOL, n


@torch.no_grad()
def test_canvas_pass_with_self_conditioning_matches_transformers(ref, ours):
    vocab = ours.embed_tokens.num_embeddings
    prompt = _ids(2 * SLIDING_WINDOW + 3, vocab, seed=1)
    cache, _ = _ref_cache(ref, prompt)
    kv = DenseKV()
    _encode(ours, kv, prompt, 0)
    canvas = _ids(CANVAS_LENGTH, vocab, seed=2)
    first = ref(decoder_input_ids=canvas[None], cache=cache).logits[0]
    ours_first = _denoise(ours, kv, canvas, len(prompt))
    assert err(ours_first, first) < TOL
    sc = first * 40  # sharpen so the soft embeddings are far from the mean embedding
    second = ref(decoder_input_ids=canvas[None], cache=cache, self_conditioning_logits=sc[None]).logits[0]
    ours_second = _denoise(ours, kv, canvas, len(prompt), sc)
    assert err(ours_second, second) < TOL
    assert (second - first).abs().max().item() > 1e-3  # self-conditioning changes the logits
    assert kv.num_cached(0) == len(prompt)  # the canvas pass wrote no K/V


@torch.no_grad()
def test_commit_pass_extends_the_cache_like_transformers(ref, ours):
    """After a canvas is accepted, transformers encodes it causally onto the cache; the next canvas
    then sees it (and sliding layers only their last window - 1 tokens)."""
    vocab = ours.embed_tokens.num_embeddings
    prompt, committed, canvas = _ids(5, vocab, 3), _ids(CANVAS_LENGTH, vocab, 4), _ids(CANVAS_LENGTH, vocab, 5)
    cache, _ = _ref_cache(ref, prompt)
    ref_commit = ref.model.encoder(input_ids=committed[None], cache=cache).last_hidden_state[0]
    ref_logits = ref(decoder_input_ids=canvas[None], cache=cache).logits[0]
    kv = DenseKV()
    _encode(ours, kv, prompt, 0)
    assert err(_encode(ours, kv, committed, 5), ref_commit) < TOL
    assert err(_denoise(ours, kv, canvas, 5 + CANVAS_LENGTH), ref_logits) < TOL


@torch.no_grad()
def test_sliding_window_limits_matter(ours):
    """Guards the parity tests: without the window the same weights give clearly different logits."""
    vocab = ours.embed_tokens.num_embeddings
    prompt, canvas = _ids(3 * SLIDING_WINDOW, vocab, 6), _ids(CANVAS_LENGTH, vocab, 7)
    kv = DenseKV()
    _encode(ours, kv, prompt, 0)
    windowed = _denoise(ours, kv, canvas, len(prompt))
    attn = DenseCanvasAttention([CanvasSegment(kv, CANVAS_LENGTH, False)], [False] * len(ours.layers), 0)
    unwindowed = ours.compute_logits(ours.denoise(canvas, torch.arange(len(prompt), len(prompt) + CANVAS_LENGTH),
                                                  attn))
    assert (windowed - unwindowed).abs().max().item() > 1e-3


@torch.no_grad()
def test_batched_segments_equal_each_request_alone(ours):
    vocab = ours.embed_tokens.num_embeddings
    prompts = [_ids(n, vocab, 10 + n) for n in (4, 11, 19)]
    alone = [_encode(ours, DenseKV(), p, 0) for p in prompts]
    kvs = [DenseKV() for _ in prompts]
    attn = DenseCanvasAttention([CanvasSegment(kv, len(p), True) for kv, p in zip(kvs, prompts)],
                                ours.layer_is_sliding, ours.sliding_window)
    batched = ours.encode(torch.cat(prompts), torch.cat([torch.arange(len(p)) for p in prompts]), attn)
    assert err(batched, torch.cat(alone)) < TOL
    canvases = [_ids(CANVAS_LENGTH, vocab, 20 + i) for i in range(3)]
    alone = [_denoise(ours, kv, c, len(p)) for kv, c, p in zip(kvs, canvases, prompts)]
    attn = DenseCanvasAttention([CanvasSegment(kv, CANVAS_LENGTH, False) for kv in kvs], ours.layer_is_sliding,
                                ours.sliding_window)
    positions = torch.cat([torch.arange(len(p), len(p) + CANVAS_LENGTH) for p in prompts])
    batched = ours.compute_logits(ours.denoise(torch.cat(canvases), positions, attn))
    assert err(batched, torch.cat(alone)) < TOL


@torch.no_grad()
def test_transformers_generate_runs_on_the_tiny_checkpoint(ckpt, ref):
    """The future engine parity target: transformers' own generate() at a fixed seed, repeatable."""
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(ref.generate(prompt, max_new_tokens=2 * CANVAS_LENGTH).sequences)
    assert torch.equal(runs[0], runs[1])
    assert runs[0].shape[0] == 1 and torch.equal(runs[0][0, :7], prompt[0])
    assert 7 < runs[0].shape[1] <= 7 + 2 * CANVAS_LENGTH


def test_bidirectional_encoder_config_is_refused(ckpt):
    text = read_text_config(ckpt)
    text.use_bidirectional_attention = "all"
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        DiffusionGemmaModel(text)


def test_loader_refuses_other_model_types(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llada2_moe"}))
    with pytest.raises(ValueError, match="expected 'diffusion_gemma'"):
        load_diffusion_gemma(tmp_path)


@torch.no_grad()
def test_untied_layer_scalars_load_per_pass(ckpt, tmp_path):
    """transformers ties encoder and decoder text weights but not the `layer_scalar` buffers; a
    checkpoint whose two passes scale differently must still match in both passes."""
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    for i, (enc, dec) in enumerate(zip(model.model.encoder.language_model.layers, model.model.decoder.layers)):
        enc.layer_scalar.fill_(0.5 + 0.25 * i)
        dec.layer_scalar.fill_(2.0 - 0.25 * i)
    model.save_pretrained(str(tmp_path))
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert ref.model.encoder.language_model.layers[0].layer_scalar.item() == 0.5  # the premise holds
    assert ref.model.decoder.layers[0].layer_scalar.item() == 2.0
    ours = load_diffusion_gemma(tmp_path)
    vocab = ours.embed_tokens.num_embeddings
    prompt, canvas = _ids(11, vocab, 30), _ids(CANVAS_LENGTH, vocab, 31)
    cache, ref_hidden = _ref_cache(ref, prompt)
    kv = DenseKV()
    assert err(_encode(ours, kv, prompt, 0), ref_hidden) < TOL
    ref_logits = ref(decoder_input_ids=canvas[None], cache=cache).logits[0]
    assert err(_denoise(ours, kv, canvas, len(prompt)), ref_logits) < TOL


def test_dense_beside_experts_needs_cuda_and_zero_turns_it_off(ours):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ours.dense_beside_experts_(256)
    ours.dense_beside_experts_(0)
    assert all(layer.side_stream is None and layer.side_max_tokens == 0 for layer in ours.layers)
