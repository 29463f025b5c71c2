"""Puts recipes/ and sweeps/ on Hydra's search path, so they are config groups.

Their folder is the installed package (pip install .) or the source checkout (fluxlab.config.paths),
and it holds much else: the checkout's .venv/, .git/, build/, mlruns/; the package's code. A plain
`file://` entry on that folder made Hydra's --help walk every folder under it as a config group
(10 minutes with a venv in the checkout) and list conf/'s groups a second time as conf/<group>. The
`fluxlab://` source below is that folder with only recipes/ and sweeps/ in it.
"""
import os
from typing import List, Optional

from hydra._internal.core_plugins.file_config_source import FileConfigSource
from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult
from hydra.plugins.search_path_plugin import SearchPathPlugin

GROUP_FOLDERS = ("recipes", "sweeps")


class FluxlabSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from fluxlab.config.paths import PROJECT_ROOT

        search_path.append(provider="fluxlab", path=f"{FluxlabGroupsConfigSource.scheme()}://{PROJECT_ROOT}")


class FluxlabGroupsConfigSource(FileConfigSource):
    """A folder of which Hydra sees only the GROUP_FOLDERS."""

    @staticmethod
    def scheme() -> str:
        return "fluxlab"

    @staticmethod
    def _visible(config_path: str) -> bool:
        return config_path.strip("/").split("/")[0] in GROUP_FOLDERS

    def load_config(self, config_path: str) -> ConfigResult:
        if not self._visible(config_path):
            raise ConfigLoadError(f"Config not found : {os.path.join(self.path, config_path)}")
        return super().load_config(config_path)

    def is_group(self, config_path: str) -> bool:
        return (config_path.strip("/") == "" or self._visible(config_path)) and super().is_group(config_path)

    def is_config(self, config_path: str) -> bool:
        return self._visible(config_path) and super().is_config(config_path)

    def list(self, config_path: str, results_filter: Optional[ObjectType]) -> List[str]:
        if config_path.strip("/") == "":
            if results_filter not in (None, ObjectType.GROUP):
                return []
            return [name for name in GROUP_FOLDERS if FileConfigSource.is_group(self, name)]
        return super().list(config_path, results_filter) if self._visible(config_path) else []
