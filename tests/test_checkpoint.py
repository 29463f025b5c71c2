"""Checkpoint writer, loader and the tiny checkpoint cache."""
import hashlib
import json
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from fluxlab.checkpoint import ensure_tiny_checkpoint, write_checkpoint
from fluxlab.engine.layers.attention_dense import DenseBlockCausalAttention
from fluxlab.models.llada2.loader import build_random_model, load_model, read_config
from fluxlab.models.llada2.special_ids import special_token_ids


def _logits(model, ids):
    return model.compute_logits(model(ids, torch.arange(len(ids)), DenseBlockCausalAttention([len(ids)], 8)))


def _tokens(n=19, vocab=1000):
    return torch.arange(n) * 37 % vocab


def _digests(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_config_json_has_published_fields(tiny_ckpt):
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    assert cfg["model_type"] == "llada2_moe"
    assert cfg["architectures"] == ["LLaDA2MoeModelLM"]
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_llada2_moe.LLaDA2MoeModelLM"
    assert cfg["torch_dtype"] == "float32"
    assert 0 <= cfg["pad_token_id"] < cfg["vocab_size"]
    for key in ["num_experts", "num_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
                "routed_scaling_factor", "first_k_dense_replace", "partial_rotary_factor", "moe_intermediate_size"]:
        assert key in cfg, key
    assert cfg["first_k_dense_replace"] == 1 and cfg["num_hidden_layers"] >= 2
    gen = json.loads((tiny_ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == special_token_ids(tiny_ckpt)[1]


def test_tokenizer_special_tokens_and_chat_template(tiny_ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt), trust_remote_code=False)
    mask_id, eos_id, pad_id = special_token_ids(tiny_ckpt)
    assert tok.convert_ids_to_tokens([mask_id, eos_id]) == ["<|mask|>", "<|endoftext|>"]
    assert (tok.mask_token, tok.eos_token, tok.pad_token) == ("<|mask|>", "<|endoftext|>", "<|endoftext|>")
    assert pad_id == eos_id == json.loads((tiny_ckpt / "config.json").read_text())["pad_token_id"]
    cfg = read_config(tiny_ckpt)
    assert len(tok) == cfg.vocab_size  # every logit row decodes to a token
    for t in ["<role>", "</role>", "<|role_end|>"]:
        assert len(tok(t, add_special_tokens=False).input_ids) == 1, t
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "What is 2 + 3?"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == ("<role>SYSTEM</role>Be brief.<|role_end|><role>HUMAN</role>What is 2 + 3?<|role_end|>"
                    "<role>ASSISTANT</role>")
    ids = tok("The answer is 42.", add_special_tokens=False).input_ids
    assert tok.decode(ids) == "The answer is 42." and len(ids) < 10  # a real BPE, not bytes


def test_special_token_ids_fall_back_to_released_ids(tmp_path):
    assert special_token_ids(tmp_path) == (156895, 156892, 156892)


def test_rewrite_is_byte_identical(tmp_path):
    a = write_checkpoint("tiny", tmp_path / "a", seed=0)
    b = write_checkpoint("tiny", tmp_path / "b", seed=0)
    assert _digests(a) == _digests(b)
    c = write_checkpoint("tiny", tmp_path / "c", seed=1)
    assert _digests(c)["model.safetensors"] != _digests(a)["model.safetensors"]
    assert _digests(c)["tokenizer.json"] == _digests(a)["tokenizer.json"]


def test_save_load_round_trip_gives_identical_logits(tiny_ckpt, tiny_model):
    model, config = tiny_model
    mask_id, eos_id, _ = special_token_ids(tiny_ckpt)
    built, _ = build_random_model(config, torch.float32, seed=0, peaked=True,
                                  special_ids={"mask": mask_id, "eos": eos_id})
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), built.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    ids = _tokens(vocab=config.vocab_size)
    assert torch.equal(_logits(model, ids), _logits(built, ids))


def test_sharded_and_bf16_checkpoints_load(tmp_path, tiny_model):
    model, config = tiny_model
    from fluxlab.models.llada2.checkpoint import write_checkpoint as write_llada2_checkpoint

    sharded = write_llada2_checkpoint("tiny", tmp_path / "sharded", shard=True)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    m2, _ = load_model(sharded, torch.float32, progress=False)
    ids = _tokens(vocab=config.vocab_size)
    assert torch.equal(_logits(model, ids), _logits(m2, ids))
    bf16 = write_checkpoint("tiny", tmp_path / "bf16", dtype="bfloat16")
    m3, _ = load_model(bf16, torch.float32, progress=False)
    w = m3.layers[1].mlp.experts.w_gate_up
    assert w.dtype == torch.float32
    assert torch.equal(w, model.layers[1].mlp.experts.w_gate_up.to(torch.bfloat16).float())


def _edited_copy(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_loader_names_missing_tensor(tiny_ckpt, tmp_path):
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    path = _edited_copy(tiny_ckpt, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight'"):
        load_model(path, torch.float32, progress=False)


def test_loader_names_unexpected_tensor(tiny_ckpt, tmp_path):
    path = _edited_copy(tiny_ckpt, tmp_path / "m", lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.extra\.weight'"):
        load_model(path, torch.float32, progress=False)


def test_loader_names_wrong_shape(tiny_ckpt, tmp_path):
    name = "model.layers.1.attention.dense.weight"
    path = _edited_copy(tiny_ckpt, tmp_path / "m", lambda t: t.update({name: torch.zeros(64, 32)}))
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.attention\.dense\.weight' has shape \(64, 32\), expected \(64, 64\)"):
        load_model(path, torch.float32, progress=False)


def test_ensure_tiny_checkpoint_reuses_and_survives_races(tmp_path):
    results, errors = [], []

    def worker():
        try:
            results.append(ensure_tiny_checkpoint(tmp_path))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    path = results[0]
    assert path.parent == tmp_path and path.name.startswith("tiny_llada2-")
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary folders left behind
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_checkpoint(tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_fluxlab_cache_env_sets_default_cache(tmp_path, monkeypatch):
    from fluxlab.checkpoint import default_cache_dir

    monkeypatch.setenv("FLUXLAB_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path


def test_random_model_of_published_shape_builds_on_meta_free_path():
    # The big presets' layouts are exact; check shapes without allocating 16B parameters.
    from fluxlab.models.llada2.layout import checkpoint_layout
    from fluxlab.models.llada2.model import LLaDA2MoeConfig
    from fluxlab.models.llada2.presets import preset_config

    c = LLaDA2MoeConfig.from_dict(preset_config("llada2_mini"))
    layout = checkpoint_layout(c)
    assert layout["model.word_embeddings.weight"].shape == (157184, 2048)
    assert layout["model.layers.0.attention.query_key_value.weight"].shape == ((16 + 2 * 4) * 128, 2048)
    assert layout["model.layers.0.mlp.gate_proj.weight"].shape == (5120, 2048)
    assert layout["model.layers.19.mlp.experts.255.down_proj.weight"].shape == (2048, 512)
    assert layout["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (512, 2048)
    assert "model.layers.0.mlp.gate.weight" not in layout
    total = sum(s.shape[0] * (s.shape[1] if len(s.shape) > 1 else 1) for s in layout.values())
    assert 16.0e9 < total < 16.5e9  # LLaDA2.0-mini: 16B parameters
    f = LLaDA2MoeConfig.from_dict(preset_config("llada2_flash"))
    total = sum(s.shape[0] * (s.shape[1] if len(s.shape) > 1 else 1) for s in checkpoint_layout(f).values())
    assert 100e9 < total < 104e9  # LLaDA2.0-flash: 100B parameters


def test_build_random_tiny_equals_the_written_checkpoint(tiny_model):
    model, config = tiny_model
    built, built_config = build_random_model("tiny", torch.float32, "cpu", seed=0)
    assert built_config == config
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), built.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_published_presets_use_released_special_ids(tmp_path):
    from transformers import AutoTokenizer

    from fluxlab.models.llada2.checkpoint import _RELEASED_SPECIAL_IDS, preset_checkpoint_config
    from fluxlab.checkpoint import _tokenizer_files

    cfg, ids = preset_checkpoint_config("llada2_mini", "bfloat16")
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (157184, 2048, 20)
    assert cfg["pad_token_id"] == 156892 and cfg["torch_dtype"] == "bfloat16"
    for name, text in _tokenizer_files(_RELEASED_SPECIAL_IDS, 32768).items():
        (tmp_path / name).write_text(text)
    assert special_token_ids(tmp_path) == (156895, 156892, 156892)
    tok = AutoTokenizer.from_pretrained(str(tmp_path), trust_remote_code=False)
    assert tok.mask_token_id == 156895 and tok.eos_token_id == 156892
    assert tok("hi<|mask|>", add_special_tokens=False).input_ids[-1] == 156895
