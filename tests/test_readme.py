"""Every command the README shows runs here as printed, read out of the README itself, so an edit
that breaks one (or a change that breaks what it prints) fails a test. Only sizes are overridden
where a full run would not fit CI (`workload.num_prompts`), and GPU-only recipes are composed
(`--cfg job`) instead of served. `fluxlab serve`, `make serve` and the README's curl run in
test_front_door.py; the aiperf and lm-eval commands of docs/bench.md in test_standard_clients.py.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fluxlab.config import PROJECT_ROOT
from readme_helpers import README, code_block, first_run, without_comment

SMALL = ["workload.num_prompts=12"]  # held-out problems per bench job (all 128 take minutes on CI)


def run(command: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """A README command through bash, with this test's Python first on PATH (so `python` is it)."""
    env_path = f"{Path(sys.executable).parent}:{subprocess.os.environ['PATH']}"
    done = subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**subprocess.os.environ, "PATH": env_path})
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


def test_generate_prints_the_readmes_answer_and_stats(tmp_path):
    command, shown = first_run("python -m fluxlab generate")
    out = run(command, tmp_path).stdout.splitlines()
    assert out[0] == shown[0] == "12 - 5 = 7. The answer is 7."
    stats = next(line for line in shown if line.startswith("[stop]"))
    # the token and forward counts are the model's; the rates and times are this machine's
    counts = re.match(r"\[stop\] \d+ tokens, \d+ forwards", stats).group(0)
    pattern = re.escape(counts) + r", [\d.]+ tokens/forward, TTFT [\d.]+ ms, latency [\d.]+ ms"
    assert any(re.fullmatch(pattern, line) for line in out), (pattern, out)
    assert list(tmp_path.iterdir()) == [], "generate wrote files into the folder it was run from"


def test_bench_sweep_then_report(tmp_path):
    """`bench -m decoding.threshold=...` is one MLflow parent run with a child per threshold (in
    ./mlruns), and `report` turns the newest sweep into reports/<name>/report.md with its plots."""
    command, _ = first_run("python -m fluxlab bench -m")
    thresholds = re.search(r"decoding\.threshold=([\d.,]+)", command).group(1).split(",")
    run(" ".join([without_comment(command), *SMALL]), tmp_path)
    report_command, _ = first_run("python -m fluxlab report")
    out = run(without_comment(report_command), tmp_path)
    [report] = list((tmp_path / "reports").glob("*/report.md"))
    text = report.read_text()
    for threshold in thresholds:
        assert re.search(rf"\|\s*{re.escape(threshold)}\s*\|", text), (threshold, text[:2000])
    assert {p.name for p in report.parent.glob("*.png")} >= {"accuracy_tpf.png", "throughput_tpf.png"}
    assert str(report.parent.name) in out.stdout + out.stderr


def test_the_offline_api_snippet_prints_what_the_readme_says(tmp_path):
    snippet = code_block("## Offline API", "python")
    printed = re.search(r"prints `([^`]+)`", README[README.index("## Offline API"):]).group(1)
    done = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == printed


def test_checkpoint_writes_a_folder_that_serves(tmp_path):
    [command] = [c for c in code_block("## Commands").splitlines() if "fluxlab checkpoint" in c]
    command = without_comment(command).replace("out=DIR", f"out={tmp_path / 'ckpt'}")
    run(command, tmp_path)
    names = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names, names
    from fluxlab import LLM, SamplingParams

    llm = LLM(model=str(tmp_path / "ckpt"), overrides=["engine.dtype=float32", "engine.device=cpu"])
    [out] = llm.generate(["Hello"], SamplingParams(max_new_tokens=8, ignore_eos=True))  # random weights
    assert len(out.token_ids) == 8 and out.finish_reason == "length", out


def test_env_prints_versions(tmp_path):
    [command] = [c for c in code_block("## Commands").splitlines() if "fluxlab env" in c]
    out = run(without_comment(command), tmp_path).stdout
    import torch

    assert torch.__version__ in out and "fluxlab" in out, out


def test_commands_without_arguments_compose(tmp_path):
    """Every `python -m fluxlab CMD [...]` line of the Commands block composes its config as printed."""
    lines = [without_comment(c) for c in code_block("## Commands").splitlines() if c.startswith("python -m fluxlab")]
    assert {line.split()[3] for line in lines} == {"serve", "bench", "generate", "report", "checkpoint", "env"}
    for line in lines:
        command = re.sub(r"\s*\[.*?\]", "", line).replace('prompt="..."', 'prompt="What is 1 + 1?"')
        command = command.replace("out=DIR", f"out={tmp_path / 'dir'}")
        run(command + " --cfg job", tmp_path, timeout=120)


@pytest.mark.parametrize("example", ["python -m fluxlab serve recipe=llada2_mini_h200",
                                     "python -m fluxlab bench sweep=threshold"])
def test_recipe_and_sweep_examples(example, tmp_path):
    assert f"`{example}`" in README
    if "serve" in example:  # an H200 recipe: compose it here, the device runs it
        out = run(f"{example} --cfg job", tmp_path, timeout=120).stdout
        assert "recipe_name: llada2_mini_h200" in out
        return
    run(" ".join([example, "workload.num_prompts=4"]), tmp_path)
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    runs = mlflow.search_runs(search_all_experiments=True)
    sweep = (PROJECT_ROOT / "sweeps" / "threshold.yaml").read_text()
    points = re.search(r"decoding\.threshold: ([\d.,]+)", sweep).group(1).split(",")
    children = runs[runs["tags.mlflow.parentRunId"].notna()]
    assert sorted(float(t) for t in children["params.decoding.threshold"]) == sorted(float(p) for p in points)
