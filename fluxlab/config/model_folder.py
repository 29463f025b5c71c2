"""A checkpoint folder is enough: `model.path=DIR` without a model group picks DIR's family.

Like vLLM and SGLang, the family comes from DIR/config.json (fluxlab/models/registry.py). The CLI
(`fluxlab/__main__.py`), `compose()` and so `LLM(model=DIR)` and bench all rewrite their overrides
through `rewrite_aliases`, which calls `with_model_folder`: it puts `model=<the family's group>` in front
(whose defaults select the family's decoder), plus `model.preset=null` (the files are the shapes),
`model.name=<DIR's name>` and the family's carried config.json keys (Diffusion-Gemma: canvas_length),
each unless the user set it. A model group the user chose (`model=X`, or a recipe or sweep that
overrides /model) wins: then nothing is added, and validation refuses a folder of another family.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def _quote(value: str) -> str:
    """A Hydra override value that stays a string (folder names may hold '=', ',', spaces)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _given(overrides: Sequence[str]) -> dict[str, str]:
    """key -> value of the `key=value` overrides (`+`/`++`/`~` dropped; the last one wins)."""
    keys = {}
    for item in overrides:
        if item.startswith("-") or "=" not in item and not item.startswith("~"):
            continue
        key, _, value = item.lstrip("+~").partition("=")
        keys[key.strip()] = value.strip()
    return keys


def _overrides_model_group(folder: str, name: str) -> bool:
    """Whether recipes/NAME.yaml (sweeps/NAME.yaml) selects a model group; a file not found here (a
    user's own, on hydra.searchpath) is taken to, so that a folder never displaces its choice."""
    import yaml

    from fluxlab.config.paths import PROJECT_ROOT

    path = PROJECT_ROOT / folder / f"{_unquote(name)}.yaml"
    if not path.is_file():
        return True
    for entry in (yaml.safe_load(path.read_text()) or {}).get("defaults") or ():
        if isinstance(entry, dict) and any(str(k).split()[-1].strip("/") == "model" for k in entry):
            return True
    return False


def _chooses_model(keys: dict[str, str]) -> bool:
    if "model" in keys:
        return True
    return any(keys.get(group) not in (None, "", "null") and _overrides_model_group(folder, keys[group])
               for group, folder in (("recipes", "recipes"), ("recipe", "recipes"),
                                     ("sweeps", "sweeps"), ("sweep", "sweeps")))


def folder_overrides(path: str, given: dict[str, str]) -> list[str]:
    """The overrides a checkpoint folder adds: its family's model group and carried keys."""
    from fluxlab.models.registry import family_of_config, read_config

    config = read_config(path)
    family = family_of_config(config, f"model.path={path} config.json")
    added = [f"model={family.group}"]
    if "model.preset" not in given:
        added.append("model.preset=null")
    if "model.name" not in given:
        added.append(f"model.name={_quote(Path(path).expanduser().resolve().name)}")
    for source, key in family.carry.items():
        if key not in given and config.get(source) is not None:
            added.append(f"{key}={config[source]}")
    return added


def with_model_folder(overrides: Sequence[str]) -> list[str]:
    """`overrides` with the checkpoint folder's family put in front (see the module doc); unchanged when
    model.path is not a folder here (an HF id, a sweep over paths, null) or a model group is chosen.
    Raises ConfigError for a folder without config.json or of no registered family."""
    from fluxlab.models.registry import UnknownModelFamily

    keys = _given(overrides)
    path: Optional[str] = keys.get("model.path")
    if path is None or _chooses_model(keys):
        return list(overrides)
    path = _unquote(path)
    if not Path(path).expanduser().is_dir():
        return list(overrides)
    try:
        return folder_overrides(path, keys) + list(overrides)
    except UnknownModelFamily as err:
        from fluxlab.config.validate import ConfigError

        raise ConfigError(str(err)) from None
