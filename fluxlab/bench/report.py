"""`python -m fluxlab report`: MLflow runs -> reports/<name>/report.md + PNG plots.

The selection is a sweep's parent run (id or name: its children are reported), an experiment name
(every job of it), or nothing (the newest sweep of tracking.experiment). The x axis is the swept
key the parent recorded, else whichever param differs between the runs. A sweep's table also gives
each job's right answers and its token agreement with a baseline job (`baseline`, default job 0;
fluxlab/bench/compare.py), so variants of one model (bf16 / fp8 weights) read side by side.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import pandas as pd
from omegaconf import DictConfig

from fluxlab.bench import compare, tracking

COLUMNS = ("output_throughput", "request_throughput", "tokens_per_forward", "forwards", "tokens_edited",
           "mean_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "p99_e2e_latency_ms", "completed", "failed", "accuracy")
LOAD_KEYS = ("bench.request_rate", "bench.max_concurrency")
# Params that differ between any two runs without being what was compared.
NOT_SWEPT = ("tracking.run_name",)


def _search(experiment_ids: list[str], where: str = "") -> pd.DataFrame:
    import mlflow

    return mlflow.search_runs(experiment_ids=experiment_ids, filter_string=where, output_format="pandas",
                              order_by=["attributes.start_time DESC"])


def select_runs(cfg: DictConfig) -> tuple[str, pd.DataFrame, Optional[pd.Series]]:
    """(report name, the runs to report, their parent run or None) for `cfg.selection`."""
    import mlflow

    mlflow.set_tracking_uri(tracking.store_uri(cfg.tracking))
    experiments = {e.name: e.experiment_id for e in mlflow.search_experiments()}
    if not experiments:
        raise ValueError(f"no MLflow experiments in {tracking.store_uri(cfg.tracking)}; run bench first")
    selection = cfg.selection
    if selection in experiments:
        runs = _search([experiments[selection]])
        runs = runs[runs.get(f"tags.{tracking.SWEEP_TAG}", pd.Series(index=runs.index)).isna()]
        return selection, runs, None
    every = list(experiments.values())
    if selection is None:
        exp_id = experiments.get(cfg.tracking.experiment)
        if exp_id is None:
            raise ValueError(f"no MLflow experiment {cfg.tracking.experiment!r}: set selection=EXPERIMENT_OR_RUN")
        parents = _search([exp_id], f"tags.`{tracking.SWEEP_TAG}` != ''")
        if parents.empty:
            return cfg.tracking.experiment, _search([exp_id]), None
        parent = parents.iloc[0]
    else:
        parents = _search(every, f"attributes.run_id = '{selection}'") if re.fullmatch(r"[0-9a-f]{32}", selection) \
            else _search(every, f"attributes.run_name = '{selection}'")
        if parents.empty:
            raise ValueError(f"selection={selection!r} is neither an experiment, a run id nor a run name")
        parent = parents.iloc[0]
    children = _search(every, f"tags.`{tracking.PARENT_TAG}` = '{parent.run_id}'")
    if children.empty:  # a single run: report it alone
        return str(parent.get("tags.mlflow.runName") or parent.run_id), parents.iloc[:1], None
    return str(parent.get("tags.mlflow.runName") or parent.run_id), children, parent


def swept_keys(runs: pd.DataFrame, parent: Optional[pd.Series]) -> list[str]:
    recorded = parent.get(f"tags.{tracking.SWEPT_KEYS_TAG}") if parent is not None else None
    keys = [k for k in recorded.split(",") if f"params.{k}" in runs] if isinstance(recorded, str) else []
    if keys:
        return keys
    # A group sweep (decoding=threshold,hierarchy) records the group: compare the params that differ.
    params = [c for c in runs.columns if c.startswith("params.") and c[len("params."):] not in NOT_SWEPT]
    return [c[len("params."):] for c in params if runs[c].nunique(dropna=False) > 1]


def _axis(runs: pd.DataFrame, key: Optional[str]) -> pd.Series:
    if key is None:  # nothing swept (a single run): each run's name, a categorical axis
        names = runs["tags.mlflow.runName"] if "tags.mlflow.runName" in runs else pd.Series(index=runs.index)
        return names.fillna(runs["run_id"].str[:8]).astype(str).rename("run")
    raw = runs[f"params.{key}"]
    numeric = pd.to_numeric(raw, errors="coerce")
    if numeric.notna().sum() == raw.notna().sum():  # runs without the key (a mixed experiment) stay NaN
        return numeric.rename(key)
    return raw.fillna("").astype(str).rename(key)


def _markdown(frame: pd.DataFrame) -> str:
    """A pipe table (pandas' to_markdown needs the optional `tabulate` package)."""
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "" if pd.isna(value) else f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def _plot(out_dir: Path, runs: pd.DataFrame, x: pd.Series) -> list[tuple[str, str]]:
    """(title, png name) of each plot written; failed runs are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = runs[runs["status"] == "FINISHED"].assign(_x=x).sort_values("_x")
    metric = lambda name: ok.get(f"metrics.{name}")  # noqa: E731
    plots = []
    if metric("output_throughput") is not None:
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        left.plot(ok["_x"], metric("output_throughput"), marker="o")
        left.set(xlabel=x.name, ylabel="output tokens/s", title="output throughput")
        right.plot(ok["_x"], metric("tokens_per_forward"), marker="o", color="tab:orange")
        right.set(xlabel=x.name, ylabel="tokens per forward", title="tokens per forward (TPF)")
        fig.tight_layout()
        fig.savefig(out_dir / "throughput_tpf.png", dpi=100)
        plt.close(fig)
        plots.append((f"Throughput and TPF vs {x.name}", "throughput_tpf.png"))
    if metric("p99_e2e_latency_ms") is not None:
        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        for ax, latency in zip(axes, ("e2e_latency", "ttft", "itl")):
            for stat in ("median", "p90", "p99"):
                ax.plot(ok["_x"], metric(f"{stat}_{latency}_ms"), marker="o", label=stat)
            ax.set(xlabel=x.name, ylabel="ms", title=latency)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "latency.png", dpi=100)
        plt.close(fig)
        plots.append((f"Latency percentiles vs {x.name}", "latency.png"))
    if metric("accuracy") is not None and metric("accuracy").notna().any():
        fig, ax = plt.subplots(figsize=(5, 4))
        ax.plot(metric("tokens_per_forward"), metric("accuracy"), marker="o", linestyle="")
        for _, row in ok.iterrows():
            ax.annotate(str(row["_x"]), (row["metrics.tokens_per_forward"], row["metrics.accuracy"]))
        ax.set(xlabel="tokens per forward", ylabel="accuracy", title=f"accuracy vs TPF (labels: {x.name})")
        fig.tight_layout()
        fig.savefig(out_dir / "accuracy_tpf.png", dpi=100)
        plt.close(fig)
        plots.append(("Accuracy vs tokens per forward", "accuracy_tpf.png"))
    return plots


def results_table(cfg: DictConfig, runs: pd.DataFrame, parent: Optional[pd.Series], keys: list[str],
                  x: pd.Series) -> tuple[pd.DataFrame, Optional[str]]:
    """(one row per run: swept values, job, status, right answers, token agreement with the baseline
    job, headline metrics; the baseline job's description, None when agreement is not shown)."""
    table = pd.DataFrame({k: runs[f"params.{k}"] for k in keys})
    if parent is not None and f"tags.{tracking.JOB_TAG}" in runs:
        table["job"] = runs[f"tags.{tracking.JOB_TAG}"]
    table["status"] = runs["status"]
    if "metrics.scored" in runs:
        right = runs["metrics.correct"].map("{:.0f}".format) + "/" + runs["metrics.scored"].map("{:.0f}".format)
        table["right"] = right.where(runs["metrics.scored"].notna(), "")
    base = compare.baseline_run(runs, cfg.baseline, is_sweep=parent is not None)
    agreement = None if base is None else compare.agreement_column(cfg.tracking, runs, base, cfg.baseline is not None)
    if agreement is not None:
        table["token_agreement"] = agreement
    for column in COLUMNS:
        if f"metrics.{column}" in runs:
            table[column] = runs[f"metrics.{column}"]
    # Numbers in their order; named variants (none, fp8) in the sweep's order, when the jobs are numbered.
    order = x if pd.api.types.is_numeric_dtype(x) or "job" not in table else pd.to_numeric(table["job"])
    table = table.assign(_x=order).sort_values("_x").drop(columns="_x")
    if agreement is None:
        return table, None
    return table, f"job {base[f'tags.{tracking.JOB_TAG}']} ({base.get('tags.mlflow.runName')})"


def write_report(cfg: DictConfig) -> str:
    """Write reports/<name>/report.md and its plots for `cfg.selection`; returns the markdown's path."""
    name, runs, parent = select_runs(cfg)
    if runs.empty:
        raise ValueError(f"no runs to report for selection={cfg.selection!r}")
    keys = swept_keys(runs, parent)
    load = [k for k in keys if k in LOAD_KEYS]
    x_key = load[0] if load else (keys[0] if keys else None)
    x = _axis(runs, x_key)
    table, baseline = results_table(cfg, runs, parent, keys, x)  # a baseline it refuses writes nothing
    out_dir = Path(cfg.out_dir) / re.sub(r"[^A-Za-z0-9_.=-]+", "_", name).strip("_")
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = _plot(out_dir, runs, x)
    first = parent if parent is not None else runs.iloc[0]
    facts = {"store": tracking.store_uri(cfg.tracking), "parent run": None if parent is None else parent.run_id,
             "command": first.get("tags.command"), "git sha": first.get("tags.git.sha"),
             "device": first.get("tags.device"), "swept": ", ".join(keys) or "nothing",
             "runs": f"{len(runs)} ({int((runs['status'] == 'FAILED').sum())} failed)",
             "token agreement with": baseline}
    lines = [f"# fluxlab report: {name}", ""]
    lines += [f"- **{k}**: `{v}`" for k, v in facts.items() if v is not None]
    lines += ["", "## Results", "", _markdown(table), ""]
    for title, png in plots:
        lines += [f"## {title}", "", f"![{title}]({png})", ""]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines))
    table.to_csv(out_dir / "runs.csv", index=False)
    return str(report.resolve())
