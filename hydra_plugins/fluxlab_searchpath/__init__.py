"""Puts the project root on Hydra's search path, so recipes/ and sweeps/ are config groups."""
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class FluxlabSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="fluxlab", path=f"file://{PROJECT_ROOT}")
