"""`python -m fluxlab bench -m ...` end to end on the tiny model: MLflow parent/child runs, online vs
offline, server reuse across per-request-key sweep points, a failing job inside a sweep."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

TINY = ["workload.max_tokens=32", "decoding.block_length=32", "engine.dtype=float32", "bench.disable_progress=true"]
METRICS = ["output_throughput", "tokens_per_forward", "forwards"] + [
    f"{stat}_{name}_ms" for stat in ("mean", "median", "std", "p90", "p95", "p99")
    for name in ("e2e_latency", "ttft", "tpot", "itl")]


def fluxlab(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    # Run folders go to $FLUXLAB_CACHE/runs/<command>/<time> (conf/hydra/default.yaml); mlruns/ to the cwd.
    done = subprocess.run([sys.executable, "-m", "fluxlab", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "FLUXLAB_CACHE": str(cwd / "cache")})
    assert done.returncode == 0, f"fluxlab {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


def runs_of(cwd: Path) -> pd.DataFrame:
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{cwd / 'mlruns' / 'mlflow.db'}")
    return mlflow.search_runs(search_all_experiments=True)


def results_of(cwd: Path) -> list[dict]:
    """The sweep-level results.jsonl (one line per job, in job order)."""
    (path,) = cwd.glob("cache/runs/bench/*/results.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def requests_of(result: dict, cwd: Path) -> pd.DataFrame:
    (path,) = [p for p in cwd.glob("cache/runs/bench/*/*/requests.csv") if json.loads(
        (p.parent / "results.jsonl").read_text().splitlines()[-1])["name"] == result["name"]]
    return pd.read_csv(path, keep_default_na=False).sort_values("index")


@pytest.fixture(scope="module")
def offline_sweep(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("offline_sweep")
    fluxlab(cwd, "bench", "-m", "decoding.threshold=0.7,0.9", "workload.num_prompts=8", *TINY)
    return cwd


@pytest.fixture(scope="module")
def online_sweep(tmp_path_factory):
    # Jobs in order: (0.7, 8 prompts), (0.7, 0 prompts: fails), (0.9, 8), (0.9, 0: fails).
    cwd = tmp_path_factory.mktemp("online_sweep")
    fluxlab(cwd, "bench", "-m", "bench=online", "decoding.threshold=0.7,0.9", "workload.num_prompts=8,0", *TINY)
    return cwd


def test_sweep_is_one_parent_run_with_a_child_per_job(offline_sweep):
    runs = runs_of(offline_sweep)
    parents = runs[runs["tags.mlflow.parentRunId"].isna()]
    assert len(parents) == 1 and parents.iloc[0]["status"] == "FINISHED"
    children = runs[runs["tags.mlflow.parentRunId"] == parents.iloc[0]["run_id"]]
    assert len(children) == 2 and set(children["status"]) == {"FINISHED"}
    assert sorted(children["params.decoding.threshold"]) == ["0.7", "0.9"]
    for metric in METRICS:
        assert children[f"metrics.{metric}"].notna().all(), metric
    assert (children["metrics.completed"] == 8).all()
    child = children.iloc[0]
    assert child["params.engine.dtype"] == "float32" and child["params.bench.mode"] == "offline"
    assert child["tags.git.sha"] and child["tags.device"].startswith("cpu") and child["tags.version.torch"]
    assert "decoding.threshold=0.7,0.9" in child["tags.command"]


def test_each_job_writes_a_result_line_a_request_csv_and_artifacts(offline_sweep):
    results = results_of(offline_sweep)
    assert [r["status"] for r in results] == ["ok", "ok"]
    assert len(requests_of(results[0], offline_sweep)) == 8
    run_id = results[0]["mlflow_run_id"]
    artifacts = {p.name for p in (offline_sweep / "mlruns" / "artifacts").glob(f"{run_id}/artifacts/*")}
    assert {"resolved_config.yaml", "requests.csv"} <= artifacts


@pytest.mark.parametrize("sweep", ["offline_sweep", "online_sweep"])
def test_lower_threshold_gives_at_least_as_many_tokens_per_forward(sweep, request):
    ok = {r["config"]["decoding"]["threshold"]: r for r in results_of(request.getfixturevalue(sweep))
          if r["status"] == "ok"}
    assert ok[0.7]["tokens_per_forward"] >= ok[0.9]["tokens_per_forward"] > 0


def test_offline_and_online_give_the_same_output_tokens(offline_sweep, online_sweep):
    offline = {r["config"]["decoding"]["threshold"]: r for r in results_of(offline_sweep)}
    online = {r["config"]["decoding"]["threshold"]: r for r in results_of(online_sweep) if r["status"] == "ok"}
    for threshold in (0.7, 0.9):
        a, b = requests_of(offline[threshold], offline_sweep), requests_of(online[threshold], online_sweep)
        assert list(a["output_tokens"]) == list(b["output_tokens"])
        assert list(a["prompt_tokens"]) == list(b["prompt_tokens"])
        assert list(a["text"]) == list(b["text"])
        assert list(a["token_ids"]) == list(b["token_ids"])  # the engine's ids offline, the server's online
        assert [len(ids.split()) for ids in a["token_ids"]] == list(a["output_tokens"])
        assert list(a["forwards"]) == list(b["forwards"])


@pytest.mark.parametrize("sweep", ["offline_sweep", "online_sweep"])
def test_engine_steps_are_counted_and_timed(sweep, request):
    cwd = request.getfixturevalue(sweep)
    for result in (r for r in results_of(cwd) if r["status"] == "ok"):
        per_request = requests_of(result, cwd)["forwards"]
        # Batched requests share forwards: the engine ran at least the longest request's and at
        # most all of them (warm-up steps are outside the timed window).
        assert per_request.max() <= result["engine_steps"] <= per_request.sum()
        assert 0 < result["mean_step_ms"] < 1e3 * result["duration"]
        # the host share of a step (online: the server's fluxlab:engine_host_seconds_total)
        assert 0 < result["mean_host_ms"] <= result["mean_step_ms"]


def test_server_started_once_for_per_request_key_sweep_and_stopped_at_the_end(online_sweep):
    ok = [r for r in results_of(online_sweep) if r["status"] == "ok"]
    assert len(ok) == 2
    assert ok[0]["server_pid"] == ok[1]["server_pid"]
    assert [r["server_reused"] for r in ok] == [False, True]
    with pytest.raises(ProcessLookupError):
        os.kill(ok[0]["server_pid"], 0)
    assert "fluxlab ready" in (online_sweep / "cache" / "runs").glob("bench/*/0/server.log").__next__().read_text()


def test_failing_job_is_recorded_failed_and_the_sweep_goes_on(online_sweep):
    results = results_of(online_sweep)
    assert [r["status"] for r in results] == ["ok", "failed", "ok", "failed"]
    assert "workload.num_prompts=0" in results[1]["error"]
    runs = runs_of(online_sweep)
    children = runs[runs["tags.mlflow.parentRunId"].notna()]
    assert sorted(children["status"]) == ["FAILED", "FAILED", "FINISHED", "FINISHED"]
    assert children.loc[children["status"] == "FAILED", "tags.error"].str.contains("num_prompts").all()
    parent = runs[runs["tags.mlflow.parentRunId"].isna()].iloc[0]
    assert parent["status"] == "FINISHED" and parent["tags.fluxlab.jobs_failed"] == "2"


def test_report_of_the_sweep(offline_sweep):
    path = Path(fluxlab(offline_sweep, "report").stdout.strip().splitlines()[-1])
    assert path.name == "report.md" and path.is_file()
    text = path.read_text()
    assert "decoding.threshold" in text and "tokens_per_forward" in text
    assert list(path.parent.glob("*.png"))
    table = pd.read_csv(path.parent / "runs.csv").set_index("job")  # job 0 (threshold 0.7) is the baseline
    assert table.loc[0, "token_agreement"] == 1.0 and 0 < table.loc[1, "token_agreement"] <= 1.0
    assert table.loc[0, "right"] == f"{round(table.loc[0, 'accuracy'] * 8)}/8"
