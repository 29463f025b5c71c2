"""Every group option and recipe composes and validates; each cross-field rule fails with its message."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from fluxlab.config import CONF_DIR, PROJECT_ROOT, ConfigError, compose, validate_config

pytestmark = pytest.mark.usefixtures("gpu_packages")  # CUDA configs validate as with the [gpu] extra

GROUPS = ["engine", "model", "scheduler", "attention", "decoding", "parallel", "server"]
REQUIRED_OPTIONS = {
    "model": {"arith_llada2", "tiny_llada2", "llada2_mini", "llada2_flash", "llada21_mini", "llada21_flash"},
    "scheduler": {"paged", "dynamic"},
    "attention": {"sdpa", "flashinfer", "fa4", "triton"},
    "decoding": {"threshold", "hierarchy", "joint_threshold", "joint_threshold_speed"},
    "parallel": {"single", "tp2", "tp2_ep2", "tp4_ep4", "dp2"},
}
RECIPES = ["llada2_mini_h200", "llada2_flash_tp4_ep4", "llada21_mini_quality", "llada21_mini_speed"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def valid(overrides=(), cuda=False, command="serve"):
    cfg = compose(command, list(overrides))
    notes = validate_config(cfg, cuda_available=cuda)
    return cfg, notes


def test_required_group_options_exist():
    for group, required in REQUIRED_OPTIONS.items():
        assert required <= set(options(group)), group


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_option_composes_and_validates(group, monkeypatch):
    for option in options(group):
        cuda = option in ("flashinfer", "fa4", "triton")
        # a family's own decoders run on its models only (which select them themselves)
        own_model = {("decoding", "canvas"): "tiny_diffusion_gemma", ("decoding", "sdar"): "tiny_sdar"}
        model = [f"model={own_model[group, option]}"] if (group, option) in own_model else []
        cfg, _ = valid([f"{group}={option}"] + model, cuda=cuda)
        assert cfg.engine.device == ("cuda" if cuda else "cpu")


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_validates(recipe):
    cfg, _ = valid([f"recipe={recipe}"], cuda=True)
    assert cfg.recipe_name == recipe


def test_recipe_overrides_groups_and_keys():
    cfg, _ = valid(["recipe=llada2_mini_h200"], cuda=True)
    assert cfg.model.name == "llada2_mini" and cfg.attention.backend == "triton"
    assert cfg.decoding.block_length == 32 and cfg.attention.use_decode_cuda_graph
    cfg, _ = valid(["recipe=llada21_mini_speed"])
    assert (cfg.decoding.decoder, cfg.decoding.threshold, cfg.decoding.editing_threshold) == ("joint_threshold", 0.5, 0.0)


def test_user_recipe_folder_on_searchpath(tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /decoding: hierarchy\nrecipe_name: mine\ndecoding:\n  low_threshold: 0.2\n")
    cfg = compose("serve", ["recipe=mine", f"hydra.searchpath=[file://{tmp_path}]"])
    assert cfg.recipe_name == "mine" and cfg.decoding.decoder == "hierarchy" and cfg.decoding.low_threshold == 0.2


def test_table_defaults():
    cfg = compose("serve")
    expected = {
        "server.host": "0.0.0.0", "server.port": 8000, "engine.device": "auto",
        "engine.gpu_memory_utilization": 0.90, "engine.gpu_memory_safety_reserve": 0.05,
        "engine.kv_cache_layout": "paged", "engine.dtype": "bfloat16", "engine.seed": 0, "engine.page_size": None,
        "model.max_model_len": 2048, "model.max_new_tokens": 128, "model.trust_remote_code": True,
        "scheduler.max_num_seqs": 8, "scheduler.max_scheduled_tokens": 512, "scheduler.policy": "paged",
        "scheduler.num_device_pages": 0, "scheduler.enable_prefix_cache": True, "attention.backend": "auto", "attention.use_cuda_graph": False,
        "attention.use_prefill_cuda_graph": False, "attention.use_decode_cuda_graph": False,
        "attention.cuda_graph_decode_mode": "padded", "attention.cuda_graph_capture_bs": None,
        "attention.cuda_graph_capture_sizes": [64, 128, 256, 512, 1024], "decoding.block_length": 64,
        "decoding.canvas_length": 128, "decoding.max_denoising_steps": None, "decoding.decoder": "threshold",
        "decoding.threshold": 0.9, "decoding.low_threshold": 0.3, "decoding.editing_threshold": 0.5,
        "decoding.max_post_steps": 16, "parallel.tp_size": 1, "parallel.dp_size": 1, "parallel.ep_size": 1,
        "parallel.enable_dp_attention": False, "parallel.distributed_backend": "nccl",
    }
    for key, value in expected.items():
        assert OmegaConf.select(cfg, key) == value, key


def test_resolution_of_auto_and_null_keys():
    cfg, _ = valid(["scheduler.max_num_seqs=12"])
    assert cfg.engine.page_size == 64 and cfg.decoding.steps == 64 and cfg.attention.backend == "sdpa"
    assert cfg.attention.cuda_graph_capture_bs is None  # no decode graphs read it
    cfg, _ = valid(["scheduler.max_num_seqs=12", "attention.use_decode_cuda_graph=true"], cuda=True)
    assert cfg.attention.cuda_graph_capture_bs == [1, 2, 4, 8, 12]
    cfg, _ = valid([], cuda=True)
    assert cfg.engine.device == "cuda" and cfg.attention.backend == "flashinfer"
    # the reference system's --use-cuda-graph turns on decode graphs; without CUDA it is refused
    cfg, _ = valid(["attention.use_cuda_graph=true"], cuda=True)
    assert cfg.attention.use_decode_cuda_graph and cfg.attention.cuda_graph_capture_bs
    with pytest.raises(ValueError, match=r"attention.use_cuda_graph .* need a CUDA device"):
        valid(["attention.use_cuda_graph=true"])


def test_wrong_type_and_unknown_key_fail_at_compose():
    with pytest.raises((ValidationError, ConfigCompositionException)) as err:
        compose("serve", ["decoding.threshold=high"])
    assert "threshold" in str(err.value) or "threshold" in str(err.value.__cause__)
    with pytest.raises(ConfigError, match="unknown key 'engine.colour'"):
        compose("serve", ["engine.colour=red"])


RULES = [
    (["decoding.canvas_length=256"], "decoding.canvas_length=256: only Diffusion-Gemma models decode canvases"),
    (["engine.page_size=32"], "engine.page_size=32 must equal decoding.block_length=64"),
    (["model.max_model_len=1000"], "model.max_model_len=1000 must be divisible by decoding.block_length=64"),
    (["scheduler.max_scheduled_tokens=500"], "scheduler.max_scheduled_tokens=500 must be divisible by decoding.block_length=64"),
    (["attention.cuda_graph_capture_bs=[1,16]"], "attention.cuda_graph_capture_bs=[1, 16] sizes decode graphs, which are off"),
    (["engine.kv_cache_layout=dense"], "scheduler.policy=paged needs engine.kv_cache_layout=paged"),
    (["scheduler=dynamic", "engine.kv_cache_layout=dense"], "scheduler.policy=dynamic needs engine.kv_cache_layout=paged"),
    (["scheduler=static", "engine.kv_cache_layout=dense"],
     "scheduler.enable_prefix_cache=true needs engine.kv_cache_layout=paged (got dense)"),
    (["attention=flashinfer"], "attention.backend=flashinfer needs a CUDA device but engine.device=cpu; use attention=sdpa"),
    (["attention=fa4"], "attention.backend=fa4 needs a CUDA device"),
    (["parallel.tp_size=0"], "parallel.tp_size=0 must be a positive integer"),
    (["parallel.ep_size=-1"], "parallel.ep_size=-1 must be a positive integer"),
    (["parallel.tp_size=2", "parallel.ep_size=4"], "parallel.ep_size=4 with parallel.tp_size=2"),
    (["decoding.threshold=1.5"], "decoding.threshold=1.5 must be in [0, 1]"),
    (["decoding.low_threshold=-0.1"], "decoding.low_threshold=-0.1 must be in [0, 1]"),
    (["decoding.editing_threshold=2"], "decoding.editing_threshold=2.0 must be in [0, 1]"),
    (["decoding.steps=65"], "decoding.steps=65 must be in [1, decoding.block_length=64]"),
    (["decoding.decoder=nosuch"], "decoding.decoder='nosuch': use one of threshold, hierarchy, joint_threshold"),
    (["engine.device=cuda"], "engine.device='cuda' but no CUDA device is visible"),
    (["attention.use_decode_cuda_graph=true"], "attention.use_decode_cuda_graph/use_prefill_cuda_graph need a CUDA device"),
    (["attention.cuda_graph_capture_bs=[1,2]"],
     "attention.cuda_graph_capture_bs=[1, 2] sizes decode graphs, which are off: set attention.use_decode_cuda_graph=true"),
    (["attention.cuda_graph_capture_sizes=[128]"],
     "attention.cuda_graph_capture_sizes=[128] sizes prefill graphs, which are off: set attention.use_prefill_cuda_graph=true"),
    (["attention.cuda_graph_decode_mode=decomposed"],
     "attention.cuda_graph_decode_mode=decomposed chooses how batches replay CUDA graphs, which are off"),
]


@pytest.mark.parametrize("overrides,message", RULES, ids=[" ".join(o) for o, _ in RULES])
def test_each_rule_names_its_keys(overrides, message):
    with pytest.raises(ConfigError) as err:
        valid(overrides)
    assert message in str(err.value)


def test_a_resolved_config_validates_again():
    """The bench hands a validated config's resolved keys to `serve`, which validates them again."""
    for overrides, cuda in ((["model.max_model_len=512"], False),
                            (["attention.use_decode_cuda_graph=true", "attention.use_prefill_cuda_graph=true",
                              "model.max_model_len=512"], True)):
        cfg, _ = valid(overrides, cuda=cuda)
        again = OmegaConf.to_container(cfg, resolve=True)
        validate_config(OmegaConf.create(again), cuda_available=cuda)


def test_capture_bs_must_fit_max_num_seqs():
    with pytest.raises(ConfigError, match=r"attention.cuda_graph_capture_bs=\[1, 16\]: each must be in \[1, "
                                          r"scheduler.max_num_seqs=8\]"):
        valid(["attention.use_decode_cuda_graph=true", "attention.cuda_graph_capture_bs=[1,16]"], cuda=True)


def test_capture_sizes_are_filtered_with_a_note():
    cfg, notes = valid(["attention.cuda_graph_capture_sizes=[0,64,100,128,4096]", "model.max_model_len=1024",
                        "attention.use_prefill_cuda_graph=true"], cuda=True)
    assert list(cfg.attention.cuda_graph_capture_sizes) == [64, 128]
    assert any("dropped [0, 100, 4096]" in n for n in notes)


def test_dense_layout_runs_with_static_policy_without_the_prefix_cache():
    cfg, _ = valid(["scheduler=static", "engine.kv_cache_layout=dense", "scheduler.enable_prefix_cache=false"])
    assert cfg.scheduler.policy == "static"


def test_gloo_on_cpu_for_tensor_parallel():
    cfg, notes = valid(["parallel=tp2_ep2"])
    assert cfg.parallel.distributed_backend == "gloo" and any("gloo" in n for n in notes)


def run_cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "fluxlab", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=PROJECT_ROOT)


def test_help_is_fast_and_imports_no_torch():
    code = ("import sys, time; t=time.time(); from fluxlab.__main__ import main; main(['--help']); "
            "assert 'torch' not in sys.modules, 'torch imported'; print('elapsed', time.time()-t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    for command in ("serve", "bench", "generate", "report", "checkpoint", "env"):
        assert command in out.stdout
    assert float(out.stdout.split("elapsed")[1]) < 1.0
    started = time.time()
    assert run_cli("--help").returncode == 0
    assert time.time() - started < 3.0  # whole interpreter start included


def test_serve_cfg_job_prints_resolved_config():
    out = run_cli("serve", "--cfg", "job", "decoding.threshold=0.7")
    assert out.returncode == 0, out.stderr
    cfg = OmegaConf.create(out.stdout)
    assert cfg.decoding.threshold == 0.7 and cfg.server.port == 8000


def test_serve_refuses_multirun():
    out = run_cli("serve", "-m", "decoding.threshold=0.7,0.9")
    assert out.returncode == 2 and "only for bench" in out.stderr


def test_bad_config_exits_with_the_message():
    out = run_cli("serve", "decoding.threshold=1.5")
    assert out.returncode == 2 and "decoding.threshold=1.5 must be in [0, 1]" in out.stderr


def test_multirun_composes_one_config_per_sweep_point(tmp_path):
    out = subprocess.run([sys.executable, "-m", "fluxlab", "bench", "-m", "decoding.threshold=0.7,0.9",
                          "bench.dry_run=true", f"hydra.sweep.dir={tmp_path}"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    assert out.returncode == 0, out.stderr
    configs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert sorted(c["decoding"]["threshold"] for c in configs) == [0.7, 0.9]


def test_sweep_group_sets_multirun_params():
    cfg = compose("bench", ["sweep=threshold"])
    text = (PROJECT_ROOT / "sweeps" / "threshold.yaml").read_text()
    assert "MULTIRUN" in text and "decoding.threshold" in text
    assert cfg.decoding.decoder == "threshold"


def test_float32_on_cuda_uses_sdpa_and_refuses_flashinfer():
    cfg, _ = valid(["engine.dtype=float32"], cuda=True)
    assert cfg.attention.backend == "sdpa"
    with pytest.raises(ConfigError) as err:
        valid(["engine.dtype=float32", "attention=flashinfer"], cuda=True)
    assert "attention.backend=flashinfer has no float32 kernels" in str(err.value)
    with pytest.raises(ConfigError) as err:
        valid(["attention=sdpa", "attention.use_decode_cuda_graph=true"], cuda=True)
    assert "attention.use_decode_cuda_graph/use_prefill_cuda_graph need attention.backend=flashinfer" in str(err.value)


def test_fa4_is_refused_with_the_reason_where_it_cannot_run(monkeypatch):
    with pytest.raises(ConfigError, match="attention.backend=fa4 needs a CUDA device but engine.device=cpu"):
        valid(["attention=fa4"])
    with pytest.raises(ConfigError, match="attention.backend=fa4 has no float32 kernels"):
        valid(["attention=fa4", "engine.dtype=float32"], cuda=True)
    cfg, _ = valid(["attention=fa4", "attention.use_decode_cuda_graph=true",
                    "attention.use_prefill_cuda_graph=true"], cuda=True)  # FA4 runs under graphs
    assert cfg.attention.backend == "fa4"
    monkeypatch.setattr("fluxlab.config.validate._fa4_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"attention.backend=fa4 needs flash_attn.cute \(pip install flash-attn-4"):
        valid(["attention=fa4"], cuda=True)


def test_flashinfer_missing_is_refused_and_auto_falls_back_to_triton(monkeypatch):
    monkeypatch.setattr("fluxlab.config.validate._flashinfer_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"attention.backend=flashinfer needs the flashinfer package \(pip install"):
        valid(["attention=flashinfer"], cuda=True)
    cfg, notes = valid([], cuda=True)
    assert cfg.attention.backend == "triton" and any("flashinfer is not installed" in n for n in notes)
    cfg, _ = valid(["engine.dtype=float32"], cuda=True)  # exact parity stays on sdpa
    assert cfg.attention.backend == "sdpa"
    monkeypatch.setattr("fluxlab.config.validate._triton_installed", lambda: False)
    cfg, _ = valid([], cuda=True)
    assert cfg.attention.backend == "sdpa"


def test_triton_attention_is_refused_with_the_reason_where_it_cannot_run(monkeypatch):
    with pytest.raises(ConfigError, match="attention.backend=triton needs a CUDA device but engine.device=cpu"):
        valid(["attention=triton"])
    # fp32 runs (IEEE dot products), under graphs too: CUDA-graph parity runs at fp32
    cfg, _ = valid(["attention=triton", "engine.dtype=float32", "attention.use_decode_cuda_graph=true",
                    "attention.use_prefill_cuda_graph=true"], cuda=True)
    assert cfg.attention.backend == "triton" and cfg.engine.dtype == "float32"
    monkeypatch.setattr("fluxlab.config.validate._triton_installed", lambda: False)
    with pytest.raises(ConfigError, match="attention.backend=triton needs the triton package"):
        valid(["attention=triton"], cuda=True)


def test_fa4_package_probe_imports_nothing_heavy():
    from fluxlab.config.validate import _fa4_installed

    assert _fa4_installed() in (True, False)
    assert "flash_attn.cute.interface" not in sys.modules


def test_a_model_that_is_not_on_disk_is_a_clear_error_not_a_traceback():
    out = run_cli("serve", "model=llada2_mini", timeout=120)
    assert out.returncode == 2
    assert "model.path='inclusionAI/LLaDA2.0-mini' is not a local directory" in out.stderr
    assert "Traceback" not in out.stderr
