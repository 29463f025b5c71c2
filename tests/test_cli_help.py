"""The command line's front matter: `--help` (each group once, every key with its line), misspelt
keys refused with the closest one, and no run folders left in the folder a command starts from."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fluxlab.config import CONF_DIR, PROJECT_ROOT, ConfigError, compose
from fluxlab.config.schema import COMMAND_SCHEMAS, schema_keys
from hydra_plugins.fluxlab_searchpath import FluxlabGroupsConfigSource

CONF_GROUPS = {"engine", "decoding", "model", "scheduler", "attention", "parallel", "server"}


def fluxlab(*args: str, cwd: Path = PROJECT_ROOT, env: dict | None = None, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "fluxlab", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT), **(env or {})})


def junk_tree(root: Path, folders: int = 300) -> None:
    """A folder like a checkout with a venv in it: conf/ and many folders beside recipes/ and sweeps/."""
    for i in range(folders):
        (root / ".venv" / "lib" / f"pkg{i}" / "sub").mkdir(parents=True)
    (root / "conf" / "model").mkdir(parents=True)
    (root / "conf" / "model" / "x.yaml").write_text("name: x\n")
    (root / "recipes").mkdir()
    (root / "recipes" / "my_recipe.yaml").write_text("# @package _global_\nrecipe_name: my_recipe\n")
    (root / "sweeps").mkdir()


def groups_section(text: str) -> list[str]:
    lines = text.split("Groups (")[1].split("\n\n")[0].splitlines()[1:]
    return [line.split()[0] for line in lines if line.startswith("  ") and not line.startswith("   ")]


def test_the_project_root_shows_hydra_only_recipes_and_sweeps(tmp_path):
    junk_tree(tmp_path)
    source = FluxlabGroupsConfigSource(provider="fluxlab", path=f"fluxlab://{tmp_path}")
    assert source.list("", None) == ["recipes", "sweeps"]
    assert source.list("recipes", None) == ["my_recipe"]
    assert not source.is_group(".venv") and not source.is_group("conf/model") and not source.is_config("conf/model/x")
    assert source.load_config("recipes/my_recipe").header["package"] == "_global_"


def test_hydra_sees_each_group_once_from_the_checkout():
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    compose("bench")  # registers the schemas
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        groups = set(GlobalHydra.instance().config_loader().list_groups(""))
    assert groups == CONF_GROUPS | {"bench", "workload", "tracking", "recipes", "sweeps", "hydra"}


def test_serve_help_lists_each_group_once_and_describes_every_key(tmp_path):
    junk_tree(tmp_path)  # a user recipe folder with a venv's worth of folders beside it
    out = fluxlab("serve", f"hydra.searchpath=[file://{tmp_path}]", "decoding.threshold=0.7", "--help", timeout=60)
    assert out.returncode == 0, out.stderr
    groups = groups_section(out.stdout)
    assert sorted(groups) == sorted(CONF_GROUPS | {"recipe"})
    assert "my_recipe" in out.stdout and "model      arith_llada2*," in out.stdout
    assert "decoding.threshold=0.7" in out.stdout  # the value this command line runs with
    text = " ".join(out.stdout.split())  # as printed, wrapped to the terminal
    assert "decoding.threshold=0.7 commit a masked token once its probability reaches this (0..1)" in text
    for item in schema_keys(COMMAND_SCHEMAS["serve"]):
        assert item.help in text
        if item.section is None:
            assert f" {item.name}=" in text


def test_bench_help_has_its_own_groups():
    out = fluxlab("bench", "sweep=threshold", "--help", timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(groups_section(out.stdout)) == sorted(CONF_GROUPS | {"bench", "workload", "tracking", "recipe", "sweep"})
    assert "threshold*" in out.stdout and "workload.num_prompts=" in out.stdout


@pytest.mark.parametrize("command", sorted(COMMAND_SCHEMAS))
def test_every_key_has_a_one_line_description(command):
    for item in schema_keys(COMMAND_SCHEMAS[command]):
        assert item.help and "\n" not in item.help, item.name


@pytest.mark.parametrize("command,override,meant", [
    ("serve", "decoding.treshold=0.5", "decoding.threshold"),
    ("serve", "+decoding.treshold=0.5", "decoding.threshold"),
    ("serve", "++decoding.treshold=0.5", "decoding.threshold"),
    ("generate", "treshold=0.5", "decoding.threshold"),
    ("generate", "promt=hi", "prompt"),
    ("bench", "workload.num_prompt=3", "workload.num_prompts"),
    ("bench", "modle=tiny_llada2", "model"),
])
def test_a_misspelt_key_is_refused_with_the_key_meant(command, override, meant):
    out = fluxlab(command, override, "--cfg", "job", timeout=60)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr
    assert f"did you mean {meant}?" in out.stderr
    assert repr(override.lstrip("+").split("=")[0]) in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_a_misspelt_sweep_key_is_refused_before_any_job():
    out = fluxlab("bench", "-m", "decoding.treshold=0.5,0.7", "bench.dry_run=true", timeout=60)
    assert out.returncode == 2 and "did you mean decoding.threshold?" in out.stderr
    assert "{" not in out.stdout  # no job printed its config


def test_the_offline_api_refuses_a_misspelt_key():
    from fluxlab import LLM

    with pytest.raises(ConfigError, match=r"unknown key 'decoding.treshold'; did you mean decoding.threshold\?"):
        LLM(overrides=["decoding.treshold=0.5"])
    with pytest.raises(ConfigError, match=r"'decoding.treshold' is not a key .*did you mean decoding.threshold\?"):
        LLM(overrides=["+decoding.treshold=0.5"])
    with pytest.raises(ConfigError, match="unknown key 'engine.colour'"):
        compose("serve", ["engine.colour=red"])


def test_known_keys_groups_list_elements_and_hydra_keys_pass():
    cfg = compose("bench", ["model=tiny_llada2", "sweep=threshold", "attention.cuda_graph_capture_sizes.0=32",
                            "hydra.job.name=x", "tracking=none"])
    assert cfg.attention.cuda_graph_capture_sizes[0] == 32 and cfg.tracking.backend == "none"


def test_a_run_leaves_nothing_in_the_folder_it_starts_from(tmp_path):
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    out = fluxlab("generate", "prompt=What is 2 + 3?", cwd=work, env={"FLUXLAB_CACHE": str(cache)}, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "The answer is 5" in out.stdout
    assert list(work.iterdir()) == []
    (log,) = cache.glob("runs/generate/*/generate.log")
    assert (log.parent / ".hydra" / "config.yaml").is_file()


def test_hydra_run_dir_still_chooses_the_run_folder(tmp_path):
    work, run_dir = tmp_path / "work", tmp_path / "run"
    work.mkdir()
    out = fluxlab("serve", "decoding.threshold=1.5", f"hydra.run.dir={run_dir}", cwd=work, timeout=60)
    assert out.returncode == 2 and "decoding.threshold=1.5 must be in [0, 1]" in out.stderr
    assert (run_dir / ".hydra" / "config.yaml").is_file() and list(work.iterdir()) == []
