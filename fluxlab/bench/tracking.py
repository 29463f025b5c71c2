"""MLflow logging of bench runs: where the store is, what a run records, parent/child runs of a sweep.

Everything goes through an explicit MlflowClient and run ids (never mlflow's global active run), so
a sweep's parent run can stay open across jobs, callbacks and job code without shared state.
"""
from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from omegaconf import DictConfig, OmegaConf

from fluxlab.config import PROJECT_ROOT

PARENT_TAG = "mlflow.parentRunId"
SWEEP_TAG = "fluxlab.sweep"  # set on a sweep's parent run: the sweep's overrides
SWEPT_KEYS_TAG = "fluxlab.swept_keys"
JOB_TAG = "fluxlab.job"  # on a sweep's child run: its Hydra job number


def store_uri(tracking: DictConfig) -> str:
    return tracking.tracking_uri or f"sqlite:///{Path.cwd() / 'mlruns' / 'mlflow.db'}"


def artifact_location(tracking: DictConfig) -> Optional[str]:
    """Where a new experiment keeps its artifacts; None lets a tracking server choose (its
    --artifacts-destination, which it proxies, so jobs on any host can write there)."""
    if tracking.artifact_location:
        return tracking.artifact_location
    if _is_server(store_uri(tracking)):
        return None
    return (Path.cwd() / "mlruns" / "artifacts").as_uri()


def _is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def client(tracking: DictConfig) -> Any:
    return _client(store_uri(tracking))


@functools.lru_cache(maxsize=4)
def _client(uri: str) -> Any:
    from mlflow import MlflowClient

    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=uri)


def experiment_id(mlflow_client: Any, tracking: DictConfig) -> str:
    """The id of `tracking.experiment`, created (with artifacts under mlruns/) on first use."""
    found = mlflow_client.get_experiment_by_name(tracking.experiment)
    if found is not None:
        return found.experiment_id
    return mlflow_client.create_experiment(tracking.experiment, artifact_location=artifact_location(tracking))


def public_config(cfg: DictConfig) -> dict:
    """The resolved config as plain data, with secrets (server.api_key) masked: it goes to shared stores."""
    def mask(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: "***" if str(k).endswith("api_key") and v else mask(v) for k, v in node.items()}
        return [mask(v) for v in node] if isinstance(node, list) else node

    return mask(OmegaConf.to_container(cfg, resolve=True))


def flatten_params(cfg: DictConfig) -> dict[str, str]:
    """The resolved config as `group.key -> value` strings, cut to MLflow's value length limit."""
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    flat: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, Mapping) and node:
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else str(key), value)
        else:
            flat[prefix] = str(node)[:MAX_PARAM_VAL_LENGTH]

    walk("", public_config(cfg))
    return flat


@functools.lru_cache(maxsize=1)
def _git_facts() -> dict[str, str]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(PROJECT_ROOT), *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    sha = git("rev-parse", "HEAD")
    return {"git.sha": sha or "unknown", "mlflow.source.git.commit": sha or "unknown",
            "git.dirty": str(bool(git("status", "--porcelain", "--untracked-files=no")))}


def _device(cfg: DictConfig) -> str:
    import torch

    device = str(cfg.engine.device)  # "auto" in a sweep's parent, whose config is not validated
    if (device == "auto" or device.startswith("cuda")) and torch.cuda.is_available():
        index = int(device.split(":")[1]) if ":" in device else 0
        return f"{torch.cuda.get_device_name(index)} x{torch.cuda.device_count()}"
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def run_tags(cfg: DictConfig) -> dict[str, str]:
    """git sha, device, versions, the command line and the recipe of a bench run."""
    import importlib.metadata as md

    tags = dict(_git_facts())
    tags["device"] = _device(cfg)
    tags["command"] = " ".join(["python", "-m", "fluxlab", "bench", *sys.argv[1:]])
    tags["recipe"] = str(cfg.get("recipe_name") or "")
    tags["version.python"] = sys.version.split()[0]
    for pkg in ("fluxlab", "torch", "transformers", "mlflow", "flashinfer-python"):
        try:
            tags[f"version.{pkg}"] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return tags


def start_run(tracking: DictConfig, run_name: Optional[str], tags: Mapping[str, str],
              parent_run_id: Optional[str] = None) -> str:
    """A new RUNNING run (a child of `parent_run_id` when given); returns its id.

    A child may run in another process or on another host than its parent: it must find the parent
    in its store (else it would be an orphan in a store nobody reports on), and it takes the
    parent's command line (its own is the launcher's worker)."""
    mlflow_client = client(tracking)
    all_tags = dict(tags)
    if parent_run_id:
        parent = _parent_run(mlflow_client, tracking, parent_run_id)
        all_tags[PARENT_TAG] = parent_run_id
        if "command" in parent.data.tags:
            all_tags["command"] = parent.data.tags["command"]
    run = mlflow_client.create_run(experiment_id(mlflow_client, tracking), run_name=run_name, tags=all_tags)
    return run.info.run_id


def _parent_run(mlflow_client: Any, tracking: DictConfig, run_id: str) -> Any:
    from mlflow.exceptions import MlflowException

    try:
        return mlflow_client.get_run(run_id)
    except MlflowException as err:
        raise ValueError(
            f"the sweep's parent run {run_id} is not in this job's MLflow store {store_uri(tracking)}: jobs on "
            f"other hosts need tracking.tracking_uri=http://HOST:PORT (an `mlflow server`) or a store path "
            f"they share") from err


def child_runs(tracking: DictConfig, parent_run_id: str) -> list[Any]:
    """Every run whose parent is `parent_run_id`, in any state."""
    from mlflow.entities import ViewType

    mlflow_client = client(tracking)
    where, runs, token = f"tags.`{PARENT_TAG}` = '{parent_run_id}'", [], None
    while True:
        page = mlflow_client.search_runs([experiment_id(mlflow_client, tracking)], where,
                                         run_view_type=ViewType.ALL, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _chunks(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def log_run(tracking: DictConfig, run_id: str, params: Mapping[str, str] = (), metrics: Mapping[str, float] = (),
            tags: Mapping[str, str] = (), artifacts: Iterable[Path] = ()) -> None:
    """Params, metrics, tags and files of one run (batched under MLflow's per-call limits)."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.utils.time import get_current_time_millis

    mlflow_client = client(tracking)
    now = get_current_time_millis()
    params = [Param(k, v) for k, v in dict(params).items()]
    metrics = [Metric(k, float(v), now, 0) for k, v in dict(metrics).items()]
    tags = [RunTag(k, str(v)) for k, v in dict(tags).items()]
    for batch in _chunks(params, 100):
        mlflow_client.log_batch(run_id, params=batch)
    for batch in _chunks(metrics, 1000):
        mlflow_client.log_batch(run_id, metrics=batch)
    if tags:
        mlflow_client.log_batch(run_id, tags=tags)
    for path in artifacts:
        if Path(path).is_file():
            mlflow_client.log_artifact(run_id, str(path))


def end_run(tracking: DictConfig, run_id: str, failed: bool = False) -> None:
    client(tracking).set_terminated(run_id, "FAILED" if failed else "FINISHED")
