"""LLaDA2.2 presets and checkpoints: config fields, edit and stop ids, `fluxlab checkpoint preset=tiny_llada22`."""
import json
import subprocess
import sys

import pytest
import torch

from fluxlab.checkpoint import ensure_tiny_checkpoint
from fluxlab.models.llada2.checkpoint import preset_checkpoint_config
from fluxlab.config import compose
from fluxlab.models.llada2.loader import build_random_model, load_model, read_config
from fluxlab.models.llada2.special_ids import special_ids, special_token_ids
from fluxlab.models.llada2.model import LLaDA2MoeConfig, check_block_length


@pytest.fixture(scope="module")
def tiny22(tmp_path_factory):
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("cache22"), preset="tiny_llada22")


@pytest.mark.parametrize("preset,hidden", [("llada22_mini", 2048), ("llada22_flash", 4096)])
def test_published_llada22_presets_are_llada20_shapes_plus_block_routing(preset, hidden):
    cfg, tokens = preset_checkpoint_config(preset, "bfloat16")
    assert (cfg["hidden_size"], cfg["num_experts"], cfg["vocab_size"]) == (hidden, 256, 157184)
    assert (cfg["expert_capacity"], cfg["block_size"]) == (48, 32)
    assert (cfg["delete_token_id"], cfg["split_token_id"]) == (156930, 156931)
    assert (tokens["<|delete|>"], tokens["<|split|>"]) == (156930, 156931)
    c = LLaDA2MoeConfig.from_dict(cfg)
    assert c.routing_block_size == 32 and not {"expert_capacity", "block_size"} & set(c.extra)
    ids = special_ids(None, preset=preset)
    assert ids.stop_ids == (156892, 156900) and (ids.delete_id, ids.split_id) == (156930, 156931)
    assert compose("generate", [f"model={preset}"]).model.preset == preset


def test_llada2_presets_keep_per_token_routing_and_one_stop_id():
    c = LLaDA2MoeConfig.from_dict(preset_checkpoint_config("llada21_mini")[0])
    assert c.expert_capacity == 0 and c.routing_block_size == 0
    check_block_length(c, 8)  # no constraint without block routing
    ids = special_ids(None, preset="llada2_mini")
    assert ids.stop_ids == (156892,) and ids.delete_id is None


def test_block_length_must_be_a_multiple_of_the_routing_block():
    c = LLaDA2MoeConfig.from_dict(preset_checkpoint_config("llada22_mini")[0])
    check_block_length(c, 64)
    with pytest.raises(ValueError, match=r"decoding.block_length=48 must be a multiple of the model's routing "
                                         r"block_size=32"):
        check_block_length(c, 48)
    with pytest.raises(ValueError, match="expert_capacity=300 must be in"):
        LLaDA2MoeConfig(expert_capacity=300, block_size=32)
    with pytest.raises(ValueError, match="needs a routing block_size"):
        LLaDA2MoeConfig(expert_capacity=48)


def test_tiny_llada22_checkpoint_has_edit_tokens_two_stop_ids_and_a_restricting_pool(tiny22):
    config = read_config(tiny22)
    assert (config.expert_capacity, config.routing_block_size, config.num_experts) == (6, 8, 16)
    ids = special_ids(tiny22)
    assert special_token_ids(tiny22) == (ids.mask_id, ids.eos_id, ids.pad_id)
    assert (ids.delete_id, ids.split_id) == (config.delete_token_id, config.split_token_id)
    assert max(ids.delete_id, ids.split_id) == config.vocab_size - 1
    generation = json.loads((tiny22 / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(ids.stop_ids) and len(ids.stop_ids) == 2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny22), trust_remote_code=False)
    assert tok.convert_ids_to_tokens([ids.delete_id, ids.split_id]) == ["<|delete|>", "<|split|>"]
    assert tok.decode([ids.delete_id, 5], skip_special_tokens=True) == tok.decode([5])


def test_build_random_tiny_llada22_equals_the_written_checkpoint(tiny22):
    model, config = load_model(tiny22, torch.float32, "cpu", progress=False)
    built, built_config = build_random_model("tiny_llada22", torch.float32, "cpu", seed=0)
    assert built_config == config
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), built.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_tiny_checkpoint_is_unchanged_by_the_llada22_twin(tiny_ckpt):
    config = read_config(tiny_ckpt)
    assert config.expert_capacity == 0 and config.delete_token_id is None
    assert special_ids(tiny_ckpt).stop_ids == (special_token_ids(tiny_ckpt)[1],)


def test_fluxlab_checkpoint_command_writes_tiny_llada22(tmp_path):
    out = tmp_path / "t22"
    proc = subprocess.run([sys.executable, "-m", "fluxlab", "checkpoint", "preset=tiny_llada22", f"out={out}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert read_config(out).expert_capacity == 6
    assert len(special_ids(out).stop_ids) == 2


def _validate(overrides):
    from fluxlab.config import validate_config

    cfg = compose("generate", ["engine.device=cpu"] + overrides)
    validate_config(cfg, cuda_available=False)
    return cfg


def test_max_steps_per_block_defaults_to_1000_and_must_be_at_least_2():
    from fluxlab.config.validate import ConfigError

    assert _validate([]).decoding.max_steps_per_block == 1000
    _validate(["decoding.max_steps_per_block=2"])
    with pytest.raises(ConfigError, match=r"decoding.max_steps_per_block=1 must be in \[2, 2147483647\]"):
        _validate(["decoding.max_steps_per_block=1"])


def test_validation_refuses_a_block_length_off_the_routing_block_naming_both_keys(tiny22):
    from fluxlab.config.validate import ConfigError

    with pytest.raises(ConfigError, match=r"decoding.block_length=16 must be a multiple of the model's routing "
                                          r"block_size=32 \(block_size of model.preset=llada22_mini\)"):
        _validate(["model=llada22_mini", "model.load_format=random", "decoding.block_length=16"])
    with pytest.raises(ConfigError, match=r"decoding.block_length=12 .* block_size=8 \(block_size in model.path="):
        _validate([f"model.path={tiny22}", "model.preset=null", "decoding.block_length=12", "model.max_model_len=240",
                   "scheduler.max_scheduled_tokens=480"])
    assert _validate(["model=llada22_mini", "model.load_format=random", "decoding.block_length=64"])
    assert _validate([f"model.path={tiny22}", "model.preset=null", "decoding.block_length=16"])
    assert _validate(["decoding.block_length=12", "model.max_model_len=240", "scheduler.max_scheduled_tokens=480"])
