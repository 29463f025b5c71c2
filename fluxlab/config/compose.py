"""Compose a command's config outside `@hydra.main` (the offline LLM API, tests, bench workers)."""
from __future__ import annotations

from typing import Sequence

from omegaconf import DictConfig, OmegaConf

from fluxlab.config.paths import CONF_DIR, GROUP_ALIASES


def resolved(cfg: DictConfig) -> DictConfig:
    """The config with every `${...}` replaced by its value: what crosses a process boundary (the
    engine process, TP workers, sweep jobs). A child composes nothing and has neither our resolvers
    nor Hydra's runtime, so an interpolation left in would fail there, after the parent said ready."""
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))

def rewrite_aliases(overrides: Sequence[str]) -> list[str]:
    """Map `recipe=X` / `sweep=X` (also with `+`/`~`) onto the groups `recipes` / `sweeps`; then a
    checkpoint folder without a model group picks its family's (model_folder.py)."""
    out = []
    for item in overrides:
        prefix = item[: len(item) - len(item.lstrip("+~"))]
        body = item[len(prefix):]
        key, sep, value = body.partition("=")
        out.append(f"{prefix}{GROUP_ALIASES.get(key, key)}{sep}{value}" if key in GROUP_ALIASES else item)
    from fluxlab.config.model_folder import with_model_folder

    return with_model_folder(out)


def compose(command: str, overrides: Sequence[str] = (), return_hydra_config: bool = False) -> DictConfig:
    """The config `python -m fluxlab <command> <overrides>` would run with (before validation); a key
    the schema does not define is a ConfigError naming the closest keys (overrides.py)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from fluxlab.config.overrides import check_overrides
    from fluxlab.config.schema import register_configs

    register_configs()
    overrides = rewrite_aliases(overrides)
    check_overrides(command, overrides)
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name=command):
        return hydra_compose(config_name=command, overrides=overrides, return_hydra_config=return_hydra_config)
