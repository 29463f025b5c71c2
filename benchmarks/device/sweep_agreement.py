"""Right answers and token agreement with job 0 for a bench sweep run with tracking.backend=none (no MLflow on the
device): `python3 benchmarks/device/sweep_agreement.py SWEEP_DIR` reads each job's requests.csv under SWEEP_DIR/<job>/
and prints a row per job (what `python -m fluxlab report` shows, from the same definitions in fluxlab.bench.compare)."""
import sys
from pathlib import Path

import pandas as pd

from fluxlab.bench.compare import output_ids, token_agreement

sweep = Path(sys.argv[1])
jobs = sorted((p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
frames = {int(p.name): pd.read_csv(p / "requests.csv", keep_default_na=False, dtype={"token_ids": str})
          for p in jobs if (p / "requests.csv").exists()}
if 0 not in frames:
    sys.exit(f"{sweep}: job 0 (the baseline) has no requests.csv")
base = output_ids(frames[0])
print("| job | overrides | right | token agreement with job 0 | tokens |")
print("|---|---|---|---|---|")
for job, frame in frames.items():
    overrides = (sweep / str(job) / ".hydra" / "overrides.yaml")
    over = " ".join(l.strip("- \n") for l in overrides.read_text().splitlines()) if overrides.exists() else ""
    right = int(frame["correct"].astype(str).str.lower().eq("true").sum()) if "correct" in frame else -1
    ids = output_ids(frame)
    print(f"| {job} | {over} | {right}/{len(frame)} | {token_agreement(ids, base):.4f} | "
          f"{sum(len(v) for v in ids.values())} |")
