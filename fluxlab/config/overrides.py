"""Command-line overrides checked against the schema before Hydra composes: a misspelt key is a
clear error with the key it was probably meant to be.

Hydra refuses an unknown key (`decoding.treshold=0.5`) with a traceback-like message that suggests
`+decoding.treshold=0.5`, and that `+` form is then accepted: Hydra opens struct mode to add it, so
the key sits in the config, never read, and the run silently uses the default threshold.
"""
from __future__ import annotations

import difflib
from typing import Iterable, Sequence

from omegaconf import OmegaConf

from fluxlab.config.paths import CONF_DIR, GROUP_ALIASES
from fluxlab.config.schema import COMMAND_SCHEMAS, schema_keys


def command_groups(command: str) -> list[str]:
    """The config groups of conf/<command>.yaml's defaults list, in its order (hydra's own left out)."""
    groups = []
    for entry in OmegaConf.to_container(OmegaConf.load(CONF_DIR / f"{command}.yaml")).get("defaults", []):
        if isinstance(entry, dict):
            (name,) = entry
            group = name.split()[-1].split("@")[0].lstrip("/")  # "optional recipes", "tracking@tracking"
            if group != "hydra" and not group.startswith("hydra/"):
                groups.append(group)
    return groups


def _suggestions(name: str, candidates: Iterable[str]) -> list[str]:
    """The closest candidate; failing that, every key whose last part is closest to the name's (the
    right key without its section, or in the wrong one: `seed` -> engine.seed, workload.seed)."""
    candidates = sorted(set(candidates))
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.75)
    if close:
        return close
    by_leaf: dict[str, list[str]] = {}
    for candidate in candidates:
        by_leaf.setdefault(candidate.rsplit(".", 1)[-1], []).append(candidate)
    leaf = difflib.get_close_matches(name.rsplit(".", 1)[-1], list(by_leaf), n=1, cutoff=0.75)
    return by_leaf[leaf[0]][:3] if leaf else []


def check_overrides(command: str, overrides: Sequence[str]) -> None:
    """Raise ConfigError for an override whose key the command's schema does not define, naming the
    key and the closest keys; with a leading `+` too (adding a key nothing would read).

    Group choices (`model=llada2_mini`), `hydra.*` keys and anything Hydra cannot parse are left to
    Hydra, which names the available options itself.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from fluxlab.config.validate import ConfigError

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return
    schema = list(schema_keys(COMMAND_SCHEMAS[command]))
    keys = {k.name for k in schema}
    values = {k.name for k in schema if k.section is None}
    groups = set(command_groups(command))
    for override in parsed:
        name = override.key_or_group
        if name == "hydra" or name.startswith(("hydra.", "hydra/")) or override.package is not None:
            continue
        if name in groups or name in keys:
            continue
        if any(name.startswith(k + ".") for k in values):  # an element of a list key
            continue
        aliases = {alias for alias, group in GROUP_ALIASES.items() if group in groups}
        close = _suggestions(name, keys | groups | aliases)
        hint = f"; did you mean {' or '.join(close)}?" if close else f"; `python -m fluxlab {command} --help` lists the keys"
        text = override.input_line or name
        if override.is_add() or override.is_force_add():
            raise ConfigError(f"{text}: {name!r} is not a key of fluxlab's {command} config, and adding it "
                              f"would change nothing{hint}")
        raise ConfigError(f"{text}: unknown key {name!r}{hint}")
