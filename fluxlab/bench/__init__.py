"""Benchmarks: `python -m fluxlab bench` (online / offline, Hydra sweeps, MLflow) and `report`.

run.py is one job; workload.py the prompts; online.py / offline.py the two ways to send them;
metrics.py and scoring.py the numbers; tracking.py and sweep.py MLflow; report.py the reports.
"""
