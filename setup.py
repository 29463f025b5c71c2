"""Packaging beyond pyproject.toml: conf/, recipes/ and sweeps/ stay at the top of the checkout
(where Hydra users look for them) and travel inside the wheel as fluxlab/conf, fluxlab/recipes
and fluxlab/sweeps, which is where fluxlab.config.compose looks first. Every YAML file under them
is packaged, so a new config file needs no edit here."""
import atexit
import shutil
import tempfile

from setuptools import find_namespace_packages, setup

CONFIG_TREES = {"fluxlab.conf": "conf", "fluxlab.recipes": "recipes", "fluxlab.sweeps": "sweeps"}

# setuptools builds in ./build by default, which `pip install .` would leave in the user's checkout.
BUILD_DIR = tempfile.mkdtemp(prefix="fluxlab-build-")
atexit.register(shutil.rmtree, BUILD_DIR, ignore_errors=True)

setup(
    options={"build": {"build_base": BUILD_DIR}},
    packages=find_namespace_packages(include=["fluxlab", "fluxlab.*", "hydra_plugins", "hydra_plugins.*"],
                                     exclude=["fluxlab.assets", "fluxlab.assets.*"]) + list(CONFIG_TREES),
    package_dir=CONFIG_TREES,
    package_data={"fluxlab": ["assets/*", "assets/*/*", "kernels/moe_configs/*.json"], **{name: ["**/*.yaml"] for name in CONFIG_TREES}},
)
