"""Where configs and assets are (a source checkout or an installed wheel), the `${fluxlab_asset:...}`
resolver, and the group aliases users type. Leaf of fluxlab/config: everything else there imports it."""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf


def config_root() -> Path:
    """The folder holding conf/, recipes/ and sweeps/: inside the installed package (`pip install .`
    puts them at fluxlab/conf, fluxlab/recipes, fluxlab/sweeps), else the source checkout's root."""
    package = Path(__file__).resolve().parents[1]
    return package if (package / "conf").is_dir() else package.parent


PROJECT_ROOT = config_root()
CONF_DIR = PROJECT_ROOT / "conf"
ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"


def asset_path(name: str) -> str:
    """`${fluxlab_asset:NAME}` in configs: the absolute path of fluxlab/assets/NAME (the embedded
    model's folder, the task's held-out prompts), wherever the package is installed."""
    path = ASSETS_DIR / name
    if not path.exists():
        raise ValueError(f"${{fluxlab_asset:{name}}}: no such file or folder in {ASSETS_DIR}")
    return str(path)


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("fluxlab_asset"):
        OmegaConf.register_new_resolver("fluxlab_asset", asset_path)


# Users say recipe=NAME and sweep=NAME; the folders recipes/ and sweeps/ are the Hydra groups.
GROUP_ALIASES = {"recipe": "recipes", "sweep": "sweeps"}
