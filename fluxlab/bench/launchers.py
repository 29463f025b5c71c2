"""What a bench sweep needs to know about the Hydra launcher running its jobs.

The launchers are Hydra's plugins as they ship (basic, joblib, submitit_local, submitit_slurm);
fluxlab adds what they cannot know: how many GPUs one job's engine needs (the SLURM allocation;
the local GPU share, fluxlab/bench/gpu_slots.py) and whether jobs share this process (only then may
a server or engine outlive its job).
"""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf


def engine_gpus(parallel: Any) -> int:
    """GPUs one engine of this `parallel` group uses: tp_size per replica, dp_size replicas behind
    the router; with enable_dp_attention dp_size counts ranks of the one tp_size-rank engine."""
    replicas = 1 if parallel.enable_dp_attention else int(parallel.dp_size)
    return int(parallel.tp_size) * replicas


def launcher_kind(config: DictConfig) -> str:
    """basic | joblib | submitit_local | submitit_slurm (another plugin: its class name, lowercased)."""
    target = str(OmegaConf.select(config, "hydra.launcher._target_") or "")
    name = target.rsplit(".", 1)[-1]
    known = {"BasicLauncher": "basic", "JoblibLauncher": "joblib", "LocalLauncher": "submitit_local",
             "SlurmLauncher": "submitit_slurm"}
    return known.get(name, name.lower())


def jobs_share_this_process(config: DictConfig) -> bool:
    """The basic launcher runs every job here, one after another: a server or engine kept between
    jobs is stopped at the sweep's end. Any other launcher's job ends its own process (submitit) or
    runs in a pooled worker that outlives it (joblib), so its server or engine stops with the job."""
    return launcher_kind(config) == "basic"


def launcher_settings(config: DictConfig) -> dict[str, Any]:
    """hydra.launcher keys fluxlab sets for this sweep (before Hydra builds the launcher).

    submitit_slurm: gpus_per_node = what the sweep's `parallel` group needs, unless set (a sweep over
    parallel sizes sets the largest itself). submitit_local: gpus_per_node must stay unset, since
    the plugin would give every job the same first GPUs; fluxlab hands each job its own instead.
    """
    kind = launcher_kind(config)
    asked = OmegaConf.select(config, "hydra.launcher.gpus_per_node")
    if kind == "submitit_slurm" and asked is None:
        return {"gpus_per_node": engine_gpus(config.parallel)}
    if kind == "submitit_local" and asked:
        raise ValueError(f"hydra.launcher.gpus_per_node={asked}: submitit_local would give every job the same "
                         f"first {asked} GPU(s); leave it unset and fluxlab gives each job GPUs of its own "
                         f"(as many as its `parallel` group needs)")
    return {}
