"""Sweeps through Hydra's launcher plugins (issue 40): jobs in other processes still make one MLflow
parent run with a child per job, in a local store or on a tracking server; SLURM is checked up to
the sbatch script (no cluster here); local jobs get GPUs of their own."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pandas as pd
import pytest
from omegaconf import OmegaConf

from fluxlab.bench import tracking
from fluxlab.bench.gpu_slots import claim_gpus, release_gpus
from fluxlab.bench.launchers import engine_gpus, launcher_settings
from fluxlab.bench.sweep import UNCLOSED_ERROR, _end_parent
from fluxlab.config import CONF_DIR, compose

TINY = ["workload.num_prompts=4", "workload.max_tokens=32", "decoding.block_length=32", "engine.dtype=float32",
        "bench.disable_progress=true"]


def fluxlab(cwd: Path, *args: str, ok: bool = True, path_first: str = "", **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "FLUXLAB_CACHE": str(cwd / "cache"), "OMP_NUM_THREADS": "1", **env}
    if path_first:
        environ["PATH"] = f"{path_first}{os.pathsep}{environ['PATH']}"
    done = subprocess.run([sys.executable, "-m", "fluxlab", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=400, env=environ)
    if ok:
        assert done.returncode == 0, f"fluxlab {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


def runs_in(uri: str, experiment: str = "fluxlab") -> pd.DataFrame:
    import mlflow

    mlflow.set_tracking_uri(uri)
    return mlflow.search_runs(experiment_names=[experiment])


def parent_and_children(runs: pd.DataFrame) -> tuple[pd.Series, pd.DataFrame]:
    parent_ids = runs.get("tags.mlflow.parentRunId", pd.Series(None, index=runs.index, dtype=object))
    parents = runs[parent_ids.isna()]
    assert len(parents) == 1
    parent = parents.iloc[0]
    return parent, runs[parent_ids == parent["run_id"]]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on loopback with its own sqlite store and proxied artifacts."""
    root = tmp_path_factory.mktemp("mlflow_server")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # Its own session: `mlflow server` runs uvicorn as a child, and all of them stop together.
    # No job execution: its huey consumers are processes this test has no use for.
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts")],
        cwd=root, stdout=open(root / "server.log", "w"), stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (root / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (root / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        yield url, root
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.fixture(scope="module")
def local_sweep_on_server(mlflow_server, tmp_path_factory):
    url, _ = mlflow_server
    cwd = tmp_path_factory.mktemp("submitit_local")
    fluxlab(cwd, "bench", "-m", "hydra/launcher=submitit_local", "decoding.threshold=0.7,0.9",
            f"tracking.tracking_uri={url}", *TINY)
    return cwd, url


def test_submitit_local_jobs_are_children_of_one_parent_on_the_tracking_server(local_sweep_on_server):
    cwd, url = local_sweep_on_server
    parent, children = parent_and_children(runs_in(url))
    assert parent["status"] == "FINISHED" and parent["tags.fluxlab.launcher"] == "submitit_local"
    assert parent["tags.fluxlab.jobs_done"] == "2" and parent["tags.fluxlab.jobs_failed"] == "0"
    assert len(children) == 2 and set(children["status"]) == {"FINISHED"}
    assert sorted(children["params.decoding.threshold"]) == ["0.7", "0.9"]
    assert (children["params.engine.dtype"] == "float32").all()
    for metric in ("output_throughput", "tokens_per_forward", "forwards", "mean_e2e_latency_ms"):
        assert (children[f"metrics.{metric}"] > 0).all(), metric
    assert (children["metrics.completed"] == 4).all()
    # each child ran in a submitit process of its own, yet records the sweep's command line
    assert len(list(cwd.glob("cache/runs/bench/*/.submitit/*/*_result.pkl"))) == 2
    assert (children["tags.command"].str.contains("hydra/launcher=submitit_local")).all()
    # nothing was written to a local store: the server has it all, artifacts included (proxied)
    assert not (cwd / "mlruns").exists()
    from mlflow import MlflowClient

    artifacts = {a.path for a in MlflowClient(url).list_artifacts(children.iloc[0]["run_id"])}
    assert {"resolved_config.yaml", "requests.csv"} <= artifacts


def test_report_reads_the_sweep_from_the_tracking_server(local_sweep_on_server, tmp_path):
    from fluxlab.bench.report import write_report

    _, url = local_sweep_on_server
    path = Path(write_report(compose("report", [f"tracking.tracking_uri={url}", f"out_dir={tmp_path}"])))
    text = path.read_text()
    assert "decoding.threshold" in text and "tokens_per_forward" in text and "0.7" in text and "0.9" in text


def test_joblib_jobs_a_config_refuses_are_failed_children_with_the_error(mlflow_server, tmp_path):
    # Two loky worker processes; both points are refused before any engine loads (cheap), and the
    # sweep still ends with a child per job and a closed parent.
    fluxlab(tmp_path, "bench", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
            "engine.gpu_memory_utilization=2.0,3.0", f"tracking.tracking_uri={mlflow_server[0]}",
            "tracking.experiment=joblib", *TINY)
    parent, children = parent_and_children(runs_in(mlflow_server[0], "joblib"))
    assert parent["tags.fluxlab.launcher"] == "joblib"
    assert parent["status"] == "FAILED"  # every job failed
    assert (parent["tags.fluxlab.jobs_done"], parent["tags.fluxlab.jobs_failed"]) == ("0", "2")
    assert sorted(children["params.engine.gpu_memory_utilization"]) == ["2.0", "3.0"]
    assert set(children["status"]) == {"FAILED"}
    for _, child in children.iterrows():
        value = child["params.engine.gpu_memory_utilization"]
        assert f"config error: engine.gpu_memory_utilization={value} must be in (0, 1]" in child["tags.error"]
    (results,) = tmp_path.glob("cache/runs/bench/*/results.jsonl")
    assert [line.count('"status": "failed"') for line in results.read_text().splitlines()] == [1, 1]


def test_submitit_slurm_asks_for_the_gpus_of_the_parallel_group(tmp_path, mlflow_server):
    # No cluster here: a stand-in sbatch keeps the script submitit wrote and refuses it.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/sh\ncp "$1" "$SBATCH_SCRIPT_COPY"\necho "no cluster" >&2\nexit 1\n')
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit looks for srun before it submits
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    script = tmp_path / "job.sbatch"
    done = fluxlab(tmp_path, "bench", "-m", "hydra/launcher=submitit_slurm", "parallel=dp4_ep4_attn",
                   "hydra.launcher.partition=h200", "decoding.threshold=0.7,0.9",
                   f"tracking.tracking_uri={mlflow_server[0]}", "tracking.experiment=slurm", ok=False,
                   path_first=str(bin_dir), SBATCH_SCRIPT_COPY=str(script))
    assert done.returncode != 0 and "no cluster" in done.stderr
    lines = script.read_text().splitlines()
    for flag in ("--gpus-per-node=4", "--ntasks-per-node=1", "--nodes=1", "--partition=h200", "--array=0-1%2"):
        assert f"#SBATCH {flag}" in lines, flag
    # The sweep's parent is closed, not left RUNNING, and says why it ended early.
    parent, children = parent_and_children(runs_in(mlflow_server[0], "slurm"))
    assert parent["status"] == "FAILED" and parent["tags.fluxlab.sweep_error"] and children.empty


@pytest.mark.parametrize("group,gpus", [("single", 1), ("tp2", 2), ("dp2", 2), ("tp2_ep2", 2),
                                        ("dp2_ep2_attn", 2), ("tp4_ep4", 4), ("dp4_ep4_attn", 4)])
def test_engine_gpus_of_each_parallel_group(group, gpus):
    defaults = {"tp_size": 1, "dp_size": 1, "ep_size": 1, "enable_dp_attention": False}
    parallel = OmegaConf.merge(defaults, OmegaConf.load(CONF_DIR / "parallel" / f"{group}.yaml"))
    assert engine_gpus(parallel) == gpus


def test_launcher_settings_from_the_composed_config():
    slurm = compose("bench", ["hydra/launcher=submitit_slurm", "parallel=tp4_ep4"], return_hydra_config=True)
    assert launcher_settings(slurm) == {"gpus_per_node": 4}
    pinned = compose("bench", ["hydra/launcher=submitit_slurm", "hydra.launcher.gpus_per_node=8"],
                     return_hydra_config=True)
    assert launcher_settings(pinned) == {}
    assert launcher_settings(compose("bench", ["hydra/launcher=submitit_local"], return_hydra_config=True)) == {}
    assert launcher_settings(compose("bench", [], return_hydra_config=True)) == {}
    same_gpus = compose("bench", ["hydra/launcher=submitit_local", "hydra.launcher.gpus_per_node=1"],
                        return_hydra_config=True)
    with pytest.raises(ValueError, match="gpus_per_node=1: submitit_local would give every job the same"):
        launcher_settings(same_gpus)


def test_local_jobs_claim_separate_gpu_groups_and_wait_for_a_free_one(tmp_path):
    pool = ["0", "1", "2", "3"]
    try:
        assert claim_gpus(pool, 2, tmp_path, job_num=0) == ["0", "1"]
        assert claim_gpus(pool, 2, tmp_path, job_num=0) == ["2", "3"]  # its first choice is taken
        third: list[list[str]] = []
        waiter = threading.Thread(target=lambda: third.append(claim_gpus(pool, 2, tmp_path, 2, poll_s=0.05)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not third  # every group taken: it waits
        release_gpus()
        waiter.join(5)
        assert third and third[0] in (["0", "1"], ["2", "3"])
    finally:
        release_gpus()
    with pytest.raises(ValueError, match="needs 8 GPUs; the sweep has 4"):
        claim_gpus(pool, 8, tmp_path, job_num=0)


def _tracking(url: str, experiment: str) -> OmegaConf:
    return OmegaConf.create({"tracking_uri": url, "artifact_location": None, "experiment": experiment,
                             "run_name": None})


def test_a_child_left_running_when_the_jobs_are_over_is_marked_failed(mlflow_server):
    cfg = _tracking(mlflow_server[0], "lost_child")
    parent = tracking.start_run(cfg, "sweep", {})
    finished = tracking.start_run(cfg, "a", {}, parent_run_id=parent)
    tracking.end_run(cfg, finished)
    lost = tracking.start_run(cfg, "b", {}, parent_run_id=parent)  # its process was killed
    _end_parent(cfg, parent, jobs_over=True)
    client = tracking.client(cfg)
    assert client.get_run(lost).info.status == "FAILED"
    assert client.get_run(lost).data.tags["error"] == UNCLOSED_ERROR
    tags = client.get_run(parent).data.tags
    assert (tags["fluxlab.jobs_done"], tags["fluxlab.jobs_failed"]) == ("1", "1")
    assert client.get_run(parent).info.status == "FINISHED"


def test_a_child_needs_its_parent_in_its_own_store(mlflow_server):
    cfg = _tracking(mlflow_server[0], "orphan")
    with pytest.raises(ValueError, match="parent run 0123456789abcdef0123456789abcdef is not in this job's MLflow"):
        tracking.start_run(cfg, "orphan", {}, parent_run_id="0123456789abcdef0123456789abcdef")
