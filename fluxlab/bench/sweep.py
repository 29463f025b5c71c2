"""A bench multirun as one MLflow parent run with a child per job (Hydra callback in conf/bench.yaml),
whichever Hydra launcher runs the jobs and wherever they run.

Hydra calls on_multirun_start in the launching process, on_job_start/on_job_end in the job's, which
is another process (hydra/launcher=joblib, submitit_local) or host (submitit_slurm) unless the
launcher is the basic one. What a job needs from the sweep (the parent's run id, the swept keys, the
GPUs to share) is appended to the sweep's hydra overrides as `hydra.job.env_set.*`: every launcher
composes each job's config from those overrides, wherever it runs it, and Hydra sets them as
environment variables around the job. Launcher keys fluxlab decides (SLURM's gpus_per_node) are
set the same way, before Hydra builds the launcher. At the end the parent records how its children
ended.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, flag_override

from fluxlab.bench.launchers import engine_gpus, jobs_share_this_process, launcher_kind, launcher_settings

log = logging.getLogger("fluxlab.bench")

PARENT_ENV = "FLUXLAB_MLFLOW_PARENT_RUN_ID"
SWEPT_ENV = "FLUXLAB_SWEPT_KEYS"  # comma-separated; names each job's run by its sweep point
GPUS_ENV = "FLUXLAB_SWEEP_GPUS"  # submitit_local: the GPUs the launching process saw, for its jobs to share
UNCLOSED_ERROR = ("its job ended without closing its run (killed, out of memory, or past the launcher's "
                  "time limit); see the job's log")


def parent_run_id() -> Optional[str]:
    return os.environ.get(PARENT_ENV) or None


def job_label(overrides: list[str]) -> str:
    """A job's name: its values of the swept keys (`decoding.threshold=0.7`), else all its overrides."""
    keys = [k for k in os.environ.get(SWEPT_ENV, "").split(",") if k]
    mine = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in keys]
    return " ".join(mine or overrides)


def swept_keys(overrides: list[str], sweeper_params: Optional[dict]) -> list[str]:
    """Keys a sweep varies: `k=a,b` / range() / choice() overrides and hydra.sweeper.params."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    candidates = list(overrides) + [f"{k}={v}" for k, v in (sweeper_params or {}).items()]
    parsed = OverridesParser.create().parse_overrides(candidates)
    keys = [o.key_or_group for o in parsed if o.is_sweep_override()]
    return list(dict.fromkeys(keys))


def _tracking_on(config: DictConfig) -> bool:
    return config.tracking.backend == "mlflow" and not config.bench.dry_run


def _pass_to_jobs(config: DictConfig, env: dict[str, str]) -> None:
    """Each value becomes the environment variable of that name in every job (see the module doc)."""
    with flag_override(config.hydra.overrides, "readonly", False):
        for name, value in env.items():
            # Quoted for Hydra's override grammar; run ids, key names and GPU names never hold a quote.
            assert re.fullmatch(r"[\w.,:/@+~-]*", value), value
            config.hydra.overrides.hydra.append(f"++hydra.job.env_set.{name}='{value}'")


def _set_launcher(config: DictConfig, settings: dict[str, Any]) -> None:
    """Set hydra.launcher keys in this config (the launcher is built from it next) and in the
    overrides every job is composed from (so each job's .hydra/hydra.yaml records them)."""
    with flag_override(config.hydra, "readonly", False):
        for key, value in settings.items():
            config.hydra.launcher[key] = value
            config.hydra.overrides.hydra.append(f"hydra.launcher.{key}={value}")
            log.info("hydra.launcher.%s=%s (from the sweep's config)", key, value)


def _uses_gpus(config: DictConfig) -> bool:
    from fluxlab.bench.gpu_slots import visible_gpus

    return str(config.engine.device) != "cpu" and bool(visible_gpus())


class BenchSweepCallback(Callback):
    def __init__(self) -> None:
        self._parent: Optional[tuple[DictConfig, str]] = None  # (tracking config, run id), launching process

    # ------------------------------------------------------------------ the launching process

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        overrides = list(config.hydra.overrides.task)  # HydraConfig is not set yet at multirun start
        keys = swept_keys(overrides, config.hydra.sweeper.get("params"))
        kind = launcher_kind(config)
        if kind == "joblib" and _uses_gpus(config):
            raise ValueError("hydra/launcher=joblib runs its jobs side by side on the same GPUs: use "
                             "hydra/launcher=submitit_local (one GPU group per job) or engine.device=cpu")
        _set_launcher(config, launcher_settings(config))
        to_jobs = {SWEPT_ENV: ",".join(keys), PARENT_ENV: ""}
        if kind == "submitit_local":
            from fluxlab.bench.gpu_slots import visible_gpus

            to_jobs[GPUS_ENV] = ",".join(visible_gpus())
        if _tracking_on(config):
            to_jobs[PARENT_ENV] = self._start_parent(config, overrides, keys, kind)
        _pass_to_jobs(config, to_jobs)

    def _start_parent(self, config: DictConfig, overrides: list[str], keys: list[str], kind: str) -> str:
        from fluxlab.bench import tracking

        tags = tracking.run_tags(config)
        tags.update({tracking.SWEEP_TAG: " ".join(overrides), tracking.SWEPT_KEYS_TAG: ",".join(keys),
                     "fluxlab.launcher": kind})
        # Short and unique: it names the report folder (reports/<name>/) too.
        name = config.tracking.run_name or f"sweep-{'+'.join(keys) or 'jobs'}-{time.strftime('%Y%m%d-%H%M%S')}"
        run_id = tracking.start_run(config.tracking, name[:250], tags)
        # The parent holds what every job shares; hydra's own node cannot resolve outside a job.
        shared = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
        params = {k: v for k, v in tracking.flatten_params(shared).items() if k not in keys}
        tracking.log_run(config.tracking, run_id, params=params)
        self._parent = (config.tracking, run_id)
        # A launcher that raises (a job's process died) skips on_multirun_end; the parent still ends.
        atexit.register(self._end_interrupted_sweep)
        log.info("MLflow parent run %s (%s) in %s", run_id, name, tracking.store_uri(config.tracking))
        return run_id

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from fluxlab.bench.offline import release_llm
        from fluxlab.bench.server_process import stop_server

        stop_server()
        release_llm()
        if self._parent is not None:
            atexit.unregister(self._end_interrupted_sweep)
            _end_parent(*self._parent, jobs_over=True)
            self._parent = None

    def _end_interrupted_sweep(self) -> None:
        if self._parent is not None:
            # Jobs of another process or host may still run: their open runs are left as they are.
            _end_parent(*self._parent, jobs_over=False)
            self._parent = None

    # ------------------------------------------------------------------ the job's process

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        pool = [g for g in os.environ.get(GPUS_ENV, "").split(",") if g]
        if launcher_kind(config) != "submitit_local" or not pool:
            return
        from fluxlab.bench.gpu_slots import claim_gpus

        need = engine_gpus(config.parallel)
        if need > len(pool):  # the engine refuses, naming the count it needs: a FAILED child says so
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(pool)
            return
        lock_dir = Path(config.hydra.runtime.output_dir).parent / ".gpu_locks"
        gpus = claim_gpus(pool, need, lock_dir, int(config.hydra.job.num))
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)  # read when CUDA starts, after this
        log.info("job %s runs on GPU %s", config.hydra.job.num, ",".join(gpus))

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if jobs_share_this_process(config):
            return
        from fluxlab.bench.gpu_slots import release_gpus
        from fluxlab.bench.offline import release_llm
        from fluxlab.bench.server_process import stop_server

        stop_server()
        release_llm()
        release_gpus()


def _end_parent(tracking_cfg: DictConfig, run_id: str, jobs_over: bool) -> None:
    """Close the parent with its children's count; once every job is over, a child still RUNNING
    lost its process and is marked FAILED."""
    from fluxlab.bench import tracking

    done = failed = 0
    for child in tracking.child_runs(tracking_cfg, run_id):
        status = child.info.status
        if status == "RUNNING" and jobs_over:
            tracking.log_run(tracking_cfg, child.info.run_id, tags={"error": UNCLOSED_ERROR})
            tracking.end_run(tracking_cfg, child.info.run_id, failed=True)
            status = "FAILED"
        done += status == "FINISHED"
        failed += status in ("FAILED", "KILLED")
    tags = {"fluxlab.jobs_done": done, "fluxlab.jobs_failed": failed}
    if not jobs_over:
        tags["fluxlab.sweep_error"] = "the launcher stopped before every job ended; see the sweep's log"
    tracking.log_run(tracking_cfg, run_id, tags=tags)
    # A sweep with some failed points still produced results; only an all-failed or cut-short one failed.
    tracking.end_run(tracking_cfg, run_id, failed=not jobs_over or (failed > 0 and done == 0))
