"""A bench sweep run as a user runs it (`python -m fluxlab bench sweep=NAME`, then the report), for tests."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def sweep_report_table(tmp_path: Path, sweep: str, index: str):
    """The report's runs.csv (a pandas frame indexed by the swept key `index`) of `bench sweep=<sweep>`
    run in tmp_path on one torch thread, its tiny-model cache under tmp_path."""
    import pandas as pd

    from fluxlab.bench.report import write_report
    from fluxlab.config import compose

    env = {**os.environ, "FLUXLAB_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "fluxlab", "bench", f"sweep={sweep}", "bench.disable_progress=true"],
                   cwd=tmp_path, env=env, check=True, capture_output=True, timeout=600)
    report = write_report(compose("report", [f"tracking.tracking_uri=sqlite:///{tmp_path}/mlruns/mlflow.db",
                                             f"out_dir={tmp_path / 'reports'}"]))
    return pd.read_csv(os.path.join(os.path.dirname(report), "runs.csv")).set_index(index)
