"""`python -m fluxlab bench`: one benchmark job (a sweep runs this once per point).

A job: load the workload, run it online (against bench.url or a server started from this config)
or offline (the engine in-process), score it, compute the metrics, then write a result line to
results.jsonl and a per-request CSV in the Hydra output dir, log to MLflow and print a short table.
In a multirun a failing job is recorded (MLflow status FAILED, a failed result line) and the sweep
goes on; a single run re-raises.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from fluxlab.bench import tracking
from fluxlab.bench.metrics import HEADLINE, EngineSteps, RequestRecord, compute_metrics, records_frame
from fluxlab.bench.scoring import get_scorer
from fluxlab.bench.server_process import PER_REQUEST_KEYS
from fluxlab.bench.sweep import job_label, parent_run_id
from fluxlab.bench.workload import BenchPrompt, load_workload

log = logging.getLogger("fluxlab.bench")


@dataclass
class Job:
    """Where this job writes, and whether it is one point of a multirun."""

    out_dir: Path
    name: str
    overrides: list[str]
    multirun: bool
    sweep_dir: Optional[Path] = None
    num: Optional[int] = None  # Hydra's job number in a sweep: 0 is its first point

    @property
    def tags(self) -> dict[str, str]:
        """What a sweep's child run records of its job (the report's default baseline is job 0)."""
        return {tracking.JOB_TAG: str(self.num)} if self.multirun else {}

    @classmethod
    def current(cls) -> "Job":
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():  # called as a library, outside @hydra.main
            return cls(out_dir=Path.cwd(), name="bench", overrides=[], multirun=False)
        hc = HydraConfig.get()
        multirun = hc.mode == RunMode.MULTIRUN
        overrides = list(hc.overrides.task)
        name = (job_label(overrides) if multirun else " ".join(overrides)) or "bench"
        return cls(out_dir=Path(hc.runtime.output_dir), name=name, overrides=overrides, multirun=multirun,
                   sweep_dir=Path(hc.sweep.dir) if multirun else None, num=int(hc.job.num) if multirun else None)


@dataclass
class Outcome:
    records: list[RequestRecord] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)  # server pid/reuse, url, ...
    artifacts: list[Path] = field(default_factory=list)


def request_knobs(cfg: DictConfig) -> dict[str, Any]:
    """The per-request decoding keys, sent with every request so a kept server or engine obeys this job:
    those the model's family reads (a server refuses another family's knobs with a 400)."""
    from fluxlab.server.served_fields import served_knobs

    served = served_knobs(cfg.model)
    return {key: cfg.decoding[key] for key in PER_REQUEST_KEYS if key in served}


def _tokenizer(cfg: DictConfig) -> Any:
    """The model's tokenizer alone (online random prompts), without building an engine."""
    from fluxlab.engine.loading import load_tokenizer, resolve_model_dir

    return load_tokenizer(resolve_model_dir(cfg.model))


def _run_online(cfg: DictConfig, job: Job, prompts: list[BenchPrompt], outcome: Outcome
                ) -> tuple[list[RequestRecord], float, Optional[EngineSteps]]:
    from fluxlab.bench.online import run_online

    url, model = cfg.bench.url, cfg.server.served_model_name
    if url is None:
        from fluxlab.bench.server_process import acquire_server

        server, reused = acquire_server(cfg, job.out_dir / "server.log")
        url, log_start = server.url, server.log_size() if reused else 0
        outcome.facts.update(server_pid=server.pid, server_reused=reused)
        outcome.facts["_server"] = (server, log_start)
    else:
        model = _served_model(url, cfg.server.api_key) or model
    outcome.facts.update(url=url, served_model=model)
    return run_online(url, prompts, model, request_knobs(cfg), cfg.bench, seed=cfg.workload.seed,
                      api_key=cfg.server.api_key)


def _served_model(url: str, api_key: Optional[str]) -> Optional[str]:
    """The model an external server serves (its name need not match this config's model group)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        models = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=10).json()["data"]
        return models[0]["id"] if models else None
    except (httpx.HTTPError, KeyError, ValueError):
        return None


def _save_server_log(job: Job, outcome: Outcome) -> None:
    """This job's part of the server log (a reused server's log started in an earlier job's dir)."""
    server, log_start = outcome.facts.pop("_server", (None, 0))
    target = job.out_dir / "server.log"
    if server is None:  # no server, or one that died starting: its log says why
        if target.is_file():
            outcome.artifacts.append(target)
        return
    if server.log_path != target:
        with open(server.log_path, "rb") as source:
            source.seek(log_start)
            target.write_bytes(source.read())
    outcome.artifacts.append(target)


def _execute(cfg: DictConfig, job: Job, outcome: Outcome) -> None:
    mode = cfg.bench.mode
    if mode == "offline":
        from fluxlab.bench.offline import acquire_llm, run_offline

        random = cfg.workload.kind == "random"
        prompts = None if random else load_workload(cfg)  # a bad workload fails before the engine loads
        llm, reused = acquire_llm(cfg)
        outcome.facts["engine_reused"] = reused
        prompts = load_workload(cfg, llm.tokenizer) if random else prompts
        records, duration, steps = run_offline(llm, prompts, request_knobs(cfg), cfg.bench.warmup_requests,
                                               cfg.bench.disable_progress)
    elif mode == "online":
        prompts = load_workload(cfg, _tokenizer(cfg) if cfg.workload.kind == "random" else None)
        records, duration, steps = _run_online(cfg, job, prompts, outcome)
    else:
        raise ValueError(f"bench.mode={mode!r}: use online or offline")
    scorer = get_scorer(cfg.workload.scorer)
    for record in records:
        if scorer is not None and record.success and record.answer is not None:
            record.correct = scorer(record.text, record.answer)
    outcome.records = records
    outcome.metrics = compute_metrics(records, duration, steps)


def _write_files(cfg: DictConfig, job: Job, outcome: Outcome, status: str, error: str, run_id: Optional[str]) -> None:
    job.out_dir.mkdir(parents=True, exist_ok=True)
    config_path = job.out_dir / "resolved_config.yaml"
    config_path.write_text(OmegaConf.to_yaml(tracking.public_config(cfg)))
    outcome.artifacts.append(config_path)
    if outcome.records:
        csv_path = job.out_dir / "requests.csv"
        records_frame(outcome.records).to_csv(csv_path, index=False)
        outcome.artifacts.append(csv_path)
    line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "name": job.name, "status": status, "error": error,
            "mode": cfg.bench.mode, "workload": cfg.workload.name, "overrides": job.overrides,
            "mlflow_run_id": run_id, **{k: v for k, v in outcome.facts.items() if not k.startswith("_")},
            **outcome.metrics, "config": tracking.public_config(cfg)}
    for folder in {job.out_dir, job.sweep_dir} - {None}:
        with open(folder / cfg.bench.result_file, "a") as results:
            results.write(json.dumps(line) + "\n")


def print_table(title: str, metrics: dict[str, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in HEADLINE:
        if key in metrics:
            value = metrics[key]
            table.add_row(key, f"{value:,.0f}" if float(value).is_integer() else f"{value:,.3f}")
    Console().print(table)


def run_bench(cfg: DictConfig) -> dict:
    """Run one bench job; returns its result line (metrics and facts), or {} for a dry run."""
    if cfg.bench.dry_run:
        print(json.dumps(OmegaConf.to_container(cfg, resolve=True)), flush=True)
        return {}
    job = Job.current()
    run_id = None
    if cfg.tracking.backend == "mlflow":
        # In a sweep tracking.run_name names the parent; each child is named by its sweep point.
        name = job.name if job.multirun else (cfg.tracking.run_name or job.name)
        run_id = tracking.start_run(cfg.tracking, name[:250], {**tracking.run_tags(cfg), **job.tags},
                                    parent_run_id=parent_run_id() if job.multirun else None)
    elif cfg.tracking.backend != "none":
        raise ValueError(f"tracking.backend={cfg.tracking.backend!r}: use mlflow or none")
    outcome, failure = Outcome(), None
    try:
        _execute(cfg, job, outcome)
    except BaseException as err:  # Ctrl-C too: the run is still recorded as failed
        failure = err
        log.exception("bench job %s failed", job.name)
    error = f"{type(failure).__name__}: {failure}" if failure is not None else ""
    status = "failed" if failure is not None else "ok"
    _save_server_log(job, outcome)
    _write_files(cfg, job, outcome, status, error, run_id)
    if run_id is not None:
        tags = {k: v for k, v in outcome.facts.items() if not k.startswith("_")}
        if error:
            tags["error"] = error[:5000]
        tracking.log_run(cfg.tracking, run_id, params=tracking.flatten_params(cfg), metrics=outcome.metrics,
                         tags=tags, artifacts=outcome.artifacts)
        tracking.end_run(cfg.tracking, run_id, failed=failure is not None)
    if failure is not None:
        # One failed point of a sweep must not end the sweep; a single run (or Ctrl-C) ends with the error.
        if not job.multirun or not isinstance(failure, Exception):
            raise failure
        return {"status": status, "error": error}
    title = f"fluxlab bench ({cfg.bench.mode}, {cfg.workload.name})"
    print_table(f"{title}: {job.name}" if job.multirun else title, outcome.metrics)
    print(f"files: {job.out_dir}", flush=True)  # the run folder is in the cache, not the cwd (conf/hydra/default.yaml)
    return {"status": status, **outcome.metrics}


def record_refused_job(cfg: DictConfig, error: str) -> None:
    """A sweep job whose config validation refused: a failed result line and a FAILED child with the
    error, as for a job that failed running, so the rest of the sweep goes on."""
    job = Job.current()
    run_id = None
    if cfg.tracking.backend == "mlflow" and not cfg.bench.dry_run:
        run_id = tracking.start_run(cfg.tracking, job.name[:250], {**tracking.run_tags(cfg), **job.tags},
                                    parent_run_id())
        tracking.log_run(cfg.tracking, run_id, params=tracking.flatten_params(cfg), tags={"error": error[:5000]})
        tracking.end_run(cfg.tracking, run_id, failed=True)
    line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "name": job.name, "status": "failed", "error": error,
            "mode": cfg.bench.mode, "workload": cfg.workload.name, "overrides": job.overrides,
            "mlflow_run_id": run_id, "config": tracking.public_config(cfg)}
    job.out_dir.mkdir(parents=True, exist_ok=True)
    for folder in {job.out_dir, job.sweep_dir} - {None}:
        with open(folder / cfg.bench.result_file, "a") as results:
            results.write(json.dumps(line) + "\n")
    log.error("bench job %s refused: %s", job.name, error)
