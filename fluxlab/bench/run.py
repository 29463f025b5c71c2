"""`python -m fluxlab bench`: one benchmark job (a sweep runs this once per point)."""
from __future__ import annotations

import json

from omegaconf import DictConfig, OmegaConf


def run_bench(cfg: DictConfig) -> dict:
    if cfg.bench.dry_run:
        print(json.dumps(OmegaConf.to_container(cfg, resolve=True)), flush=True)
        return {}
    raise RuntimeError("bench is not wired yet")
