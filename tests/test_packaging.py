"""`pip install .` carries everything: conf/, recipes/, sweeps/, the embedded model, the Hydra plugin."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile

from fluxlab.config import PROJECT_ROOT


def test_the_wheel_carries_configs_and_runs_from_anywhere(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(PROJECT_ROOT)], check=True, timeout=300,
                   capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("fluxlab-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for tree in ("conf", "recipes", "sweeps"):
        for path in (PROJECT_ROOT / tree).rglob("*.yaml"):
            assert f"fluxlab/{tree}/{path.relative_to(PROJECT_ROOT / tree)}" in names
    assert {"fluxlab/assets/arith_llada2/model.safetensors", "fluxlab/assets/arith_test.jsonl",
            "hydra_plugins/fluxlab_searchpath/__init__.py", "fluxlab/train/train.py"} <= names

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    argv = [sys.executable, "-m", "fluxlab", "bench", "recipe=llada21_mini_speed", "sweep=threshold", "--cfg", "job",
            "--resolve"]
    out = subprocess.run(argv, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"path: {site}/fluxlab/assets/arith_test.jsonl" in out.stdout  # the installed copy, not the checkout
    assert "recipe_name: llada21_mini_speed" in out.stdout
