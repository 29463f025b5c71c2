"""Compose a command's config outside `@hydra.main` (the offline LLM API, tests, bench workers)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = PROJECT_ROOT / "conf"

# Users say recipe=NAME and sweep=NAME; the folders recipes/ and sweeps/ are the Hydra groups.
GROUP_ALIASES = {"recipe": "recipes", "sweep": "sweeps"}


def rewrite_aliases(overrides: Sequence[str]) -> list[str]:
    """Map `recipe=X` / `sweep=X` (also with `+`/`~`) onto the groups `recipes` / `sweeps`."""
    out = []
    for item in overrides:
        prefix = item[: len(item) - len(item.lstrip("+~"))]
        body = item[len(prefix):]
        key, sep, value = body.partition("=")
        out.append(f"{prefix}{GROUP_ALIASES.get(key, key)}{sep}{value}" if key in GROUP_ALIASES else item)
    return out


def compose(command: str, overrides: Sequence[str] = ()) -> DictConfig:
    """The config `python -m fluxlab <command> <overrides>` would run with (before validation)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from fluxlab.config.schema import register_configs

    register_configs()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name=command):
        return hydra_compose(config_name=command, overrides=rewrite_aliases(overrides))
