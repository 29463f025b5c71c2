"""A checkpoint folder is enough: `model.path=DIR` (LLM(model=DIR), the CLI, bench) picks DIR's family,
its model group, decoder and defaults from DIR/config.json (fluxlab/models/registry.py)."""
import json
import os
import subprocess
import sys

import pytest

from omegaconf import OmegaConf

from fluxlab.config import CONF_DIR, ConfigError, compose, validate_config
from fluxlab.models.registry import (DIFFUSION_GEMMA, FAMILIES, LLADA2, LLADA22, UnknownModelFamily,
                                     family_of_config)

CPU = ["engine.device=cpu", "engine.dtype=float32", "scheduler.max_num_seqs=2"]
# The named group of each tiny checkpoint: LLM(model=DIR) must give the tokens it gives with model.path=DIR.
TINY = {"tiny": ("tiny_llada2", LLADA2), "tiny_llada22": ("tiny_llada22", LLADA22),
        "tiny_diffusion_gemma": ("tiny_diffusion_gemma", DIFFUSION_GEMMA)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """preset -> a folder written by `fluxlab checkpoint` (fluxlab.checkpoint.write_checkpoint)."""
    from fluxlab.checkpoint import write_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    return {preset: write_checkpoint(preset, root / f"{preset}-ckpt") for preset in TINY}


@pytest.fixture(scope="module")
def unknown(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mdm")  # a family fluxlab does not read (SDAR was one until issue 41)
    (folder / "config.json").write_text(json.dumps({"model_type": "mdm", "architectures": ["MDMForMaskedLM"]}))
    return folder


def _cli(*args, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")  # see conftest.one_thread
    return subprocess.run([sys.executable, "-m", "fluxlab", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_registry_keys_on_architectures_then_model_type_and_tells_llada22_by_block_routing():
    llada = {"architectures": ["LLaDA2MoeModelLM"]}
    assert family_of_config(llada) is LLADA2
    assert family_of_config({"model_type": "llada2_moe", "expert_capacity": 0}) is LLADA2
    assert family_of_config({**llada, "expert_capacity": 48, "block_size": 32}) is LLADA22
    assert family_of_config({"model_type": "diffusion_gemma"}) is DIFFUSION_GEMMA
    with pytest.raises(UnknownModelFamily, match=r"model_type='qwen3'.*supported: llada2_moe .*diffusion_gemma"):
        family_of_config({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})


def test_every_preset_belongs_to_the_family_its_shapes_say():
    from fluxlab.models.diffusion_gemma.checkpoint import PRESET
    from fluxlab.models.llada2.presets import PRESETS
    from fluxlab.models.sdar.presets import PRESETS as SDAR_PRESETS

    for name, config in {**PRESETS, **SDAR_PRESETS}.items():
        assert name in family_of_config(config).presets
    assert set(DIFFUSION_GEMMA.presets) == {PRESET, "diffusion_gemma_26b_a4b"}
    assert sum(len(f.presets) for f in FAMILIES) == len(PRESETS) + 2 + len(SDAR_PRESETS)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_each_family_group_selects_the_family_decoder(family):
    """Family.decoding names the conf/decoding group (its decoder may have another name: sdar -> low_confidence_dynamic)."""
    group = OmegaConf.load(CONF_DIR / "decoding" / f"{family.decoding}.yaml")
    assert compose("generate", [f"model={family.group}"]).decoding.decoder == group.decoder


@pytest.mark.parametrize("preset", TINY)
def test_a_folder_composes_its_family_group_with_the_checkpoint_defaults(folders, preset):
    group, family = TINY[preset]
    folder = folders[preset]
    cfg = compose("generate", [f"model.path={folder}"] + CPU)
    named = compose("generate", [f"model={family.group}"])
    assert (cfg.model.path, cfg.model.name, cfg.model.preset) == (str(folder), folder.name, None)
    assert cfg.model.max_model_len == named.model.max_model_len
    assert cfg.decoding.decoder == family.decoding
    assert cfg.scheduler.enable_prefix_cache == named.scheduler.enable_prefix_cache
    if family is DIFFUSION_GEMMA:  # config.json canvas_length (8), not the 26B-A4B group's 256
        assert cfg.decoding.canvas_length == json.loads((folder / "config.json").read_text())["canvas_length"] == 8
    validate_config(cfg, cuda_available=False)
    assert cfg.decoding.block_length == (8 if family is DIFFUSION_GEMMA else 64)


def test_explicit_groups_and_keys_win_over_the_folder(folders):
    llada, gemma = folders["tiny"], folders["tiny_diffusion_gemma"]
    cfg = compose("generate", [f"model.path={llada}", "decoding=hierarchy", "model.name=mine", "model.max_model_len=512"])
    assert (cfg.decoding.decoder, cfg.model.name, cfg.model.max_model_len) == ("hierarchy", "mine", 512)
    cfg = compose("generate", [f"model.path={gemma}", "decoding.canvas_length=16"])
    assert (cfg.decoding.decoder, cfg.decoding.canvas_length) == ("canvas", 16)
    cfg = compose("generate", ["model=tiny_llada2", f"model.path={llada}"])
    assert (cfg.model.name, cfg.model.preset) == ("tiny_llada2", "tiny")
    # a recipe that selects a model group keeps it (model.path points at its weights); one that does not, doesn't
    assert compose("serve", ["recipe=llada2_mini_h200", f"model.path={llada}"]).model.preset == "llada2_mini"
    assert compose("bench", ["sweep=threshold", f"model.path={gemma}"]).decoding.decoder == "canvas"


def test_a_folder_of_another_family_than_the_chosen_group_is_refused_naming_the_folder(folders):
    gemma = folders["tiny_diffusion_gemma"]
    cfg = compose("generate", ["model=tiny_llada2", f"model.path={gemma}"] + CPU)
    with pytest.raises(ConfigError, match=rf"decoding.decoder=threshold: model.path={gemma} \(model_type "
                                          r"diffusion_gemma\) is a Diffusion-Gemma model; use decoding=canvas"):
        validate_config(cfg, cuda_available=False)
    cfg = compose("generate", [f"model.path={gemma}", "decoding=threshold"] + CPU)
    with pytest.raises(ConfigError, match=rf"model.path={gemma} \(model_type diffusion_gemma\) is a Diffusion-Gemma"):
        validate_config(cfg, cuda_available=False)


def test_an_unknown_family_or_a_folder_without_config_json_is_refused(unknown, tmp_path):
    from fluxlab.llm import LLM

    with pytest.raises(ConfigError, match=r"model_type='mdm' .*supported: llada2_moe \(LLaDA2MoeModelLM: "
                                          r"LLaDA2.0/2.1, LLaDA2.2\), diffusion_gemma"):
        LLM(model=str(unknown))
    with pytest.raises(ConfigError, match=rf"model.path={tmp_path} has no config.json"):
        LLM(model=str(tmp_path))
    with pytest.raises(ConfigError, match="model_type='mdm'"):  # an explicit group: validation refuses it
        validate_config(compose("generate", ["model=tiny_llada2", f"model.path={unknown}"] + CPU), cuda_available=False)
    out = _cli("generate", f"model.path={unknown}", "prompt=hi", timeout=60)
    assert out.returncode == 2, out.stderr
    assert "model_type='mdm'" in out.stderr and "supported: llada2_moe" in out.stderr and "diffusion_gemma" in out.stderr
    assert "Traceback" not in out.stderr
    out = _cli("serve", f"model.path={tmp_path}", timeout=60)
    assert out.returncode == 2 and "has no config.json" in out.stderr, out.stderr


@pytest.mark.parametrize("preset", TINY)
def test_llm_on_a_folder_generates_the_tokens_of_its_named_group(folders, preset, one_thread):
    from fluxlab.engine.request import SamplingParams
    from fluxlab.llm import LLM

    group, family = TINY[preset]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = ["The ducks at the market", [{"role": "user", "content": "What is 12 + 30?"}]]
    results = []
    for llm in (lambda: LLM(model=str(folders[preset]), overrides=CPU),
                lambda: LLM(model=group, overrides=[f"model.path={folders[preset]}"] + CPU)):
        llm = llm()
        try:
            results.append(([r.token_ids for r in llm.generate(prompts, params)], llm.engine.eos_ids,
                            llm.engine.mask_id, llm.engine.block_length, type(llm.engine).__name__))
        finally:
            llm.shutdown()
    assert results[0] == results[1]
    assert results[0][4] == ("CanvasEngine" if family.canvas else "LLMEngine")
    assert all(len(tokens) == 16 for tokens in results[0][0])


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_the_cli_composes_the_folder_family_for_every_command(folders, command):
    gemma = folders["tiny_diffusion_gemma"]
    out = _cli(command, f"model.path={gemma}", "--cfg", "job", timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"name: {gemma.name}" in out.stdout and "decoder: canvas" in out.stdout and "canvas_length: 8" in out.stdout


def test_cli_generate_on_a_diffusion_gemma_folder_prints_what_llm_generates(folders, one_thread):
    from fluxlab.engine.request import SamplingParams
    from fluxlab.llm import LLM

    gemma, prompt = folders["tiny_diffusion_gemma"], "Hello there"
    llm = LLM(model=str(gemma), overrides=CPU)
    try:
        want = llm.generate([[{"role": "user", "content": prompt}]], SamplingParams(max_new_tokens=16))[0]
    finally:
        llm.shutdown()
    out = _cli("generate", f"model.path={gemma}", f"prompt={prompt}", "model.max_new_tokens=16", *CPU)
    assert out.returncode == 0, out.stderr
    assert f"{want.text}\n\n[{want.finish_reason}] {len(want.token_ids)} tokens" in out.stdout  # logs come first


def test_the_cli_keeps_an_explicit_decoding_group(folders):
    llada22 = folders["tiny_llada22"]
    out = _cli("generate", f"model.path={llada22}", "decoding=levenshtein_joint", "--cfg", "job", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "decoder: levenshtein_joint" in out.stdout and f"name: {llada22.name}" in out.stdout
