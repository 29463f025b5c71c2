"""A bench multirun as one MLflow parent run with a child per job (Hydra callback in conf/bench.yaml).

The parent's id travels in an environment variable, so jobs find it whether the launcher runs them
in this process (the basic launcher) or in worker processes started after the sweep began.
At the end of the sweep the server or engine kept for reuse across jobs is stopped.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("fluxlab.bench")

PARENT_ENV = "FLUXLAB_MLFLOW_PARENT_RUN_ID"
SWEPT_ENV = "FLUXLAB_SWEPT_KEYS"  # comma-separated; names each job's run by its sweep point
_jobs = {"done": 0, "failed": 0}


def parent_run_id() -> Optional[str]:
    return os.environ.get(PARENT_ENV)


def job_label(overrides: list[str]) -> str:
    """A job's name: its values of the swept keys (`decoding.threshold=0.7`), else all its overrides."""
    keys = [k for k in os.environ.get(SWEPT_ENV, "").split(",") if k]
    mine = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in keys]
    return " ".join(mine or overrides)


def note_job(failed: bool) -> None:
    """Count a finished job, so the parent run can say how many failed."""
    _jobs["failed" if failed else "done"] += 1


def swept_keys(overrides: list[str], sweeper_params: Optional[dict]) -> list[str]:
    """Keys a sweep varies: `k=a,b` / range() / choice() overrides and hydra.sweeper.params."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    candidates = list(overrides) + [f"{k}={v}" for k, v in (sweeper_params or {}).items()]
    parsed = OverridesParser.create().parse_overrides(candidates)
    keys = [o.key_or_group for o in parsed if o.is_sweep_override()]
    return list(dict.fromkeys(keys))


def _tracking_on(config: DictConfig) -> bool:
    return config.tracking.backend == "mlflow" and not config.bench.dry_run


class BenchSweepCallback(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _jobs.update(done=0, failed=0)
        os.environ.pop(PARENT_ENV, None)
        overrides = list(config.hydra.overrides.task)  # HydraConfig is not set yet at multirun start
        keys = swept_keys(overrides, config.hydra.sweeper.get("params"))
        os.environ[SWEPT_ENV] = ",".join(keys)
        if not _tracking_on(config):
            return
        from fluxlab.bench import tracking

        tags = tracking.run_tags(config)
        tags.update({tracking.SWEEP_TAG: " ".join(overrides), tracking.SWEPT_KEYS_TAG: ",".join(keys)})
        # Short and unique: it names the report folder (reports/<name>/) too.
        name = config.tracking.run_name or f"sweep-{'+'.join(keys) or 'jobs'}-{time.strftime('%Y%m%d-%H%M%S')}"
        run_id = tracking.start_run(config.tracking, name[:250], tags)
        # The parent holds what every job shares; hydra's own node cannot resolve outside a job.
        shared = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
        params = {k: v for k, v in tracking.flatten_params(shared).items() if k not in keys}
        tracking.log_run(config.tracking, run_id, params=params)
        os.environ[PARENT_ENV] = run_id
        log.info("MLflow parent run %s (%s) in %s", run_id, name, tracking.store_uri(config.tracking))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from fluxlab.bench.offline import release_llm
        from fluxlab.bench.server_process import stop_server

        stop_server()
        release_llm()
        run_id = os.environ.pop(PARENT_ENV, None)
        os.environ.pop(SWEPT_ENV, None)
        if run_id and _tracking_on(config):
            from fluxlab.bench import tracking

            tracking.log_run(config.tracking, run_id, tags={"fluxlab.jobs_done": _jobs["done"],
                                                             "fluxlab.jobs_failed": _jobs["failed"]})
            # A sweep with some failed points still produced results; only an all-failed sweep failed.
            tracking.end_run(config.tracking, run_id, failed=_jobs["failed"] > 0 and _jobs["done"] == 0)
