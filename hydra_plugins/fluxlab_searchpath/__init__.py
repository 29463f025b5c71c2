"""Puts the folder holding recipes/ and sweeps/ on Hydra's search path, so they are config groups.

That folder is the installed package (pip install .) or the source checkout (fluxlab.config.compose).
"""
from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class FluxlabSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from fluxlab.config.compose import PROJECT_ROOT

        search_path.append(provider="fluxlab", path=f"file://{PROJECT_ROOT}")
