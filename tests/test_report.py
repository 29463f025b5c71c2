"""`report` on a synthetic MLflow store: selection, swept-key axis, markdown table and plots."""
from __future__ import annotations

from pathlib import Path

import pytest

from fluxlab.bench import tracking
from fluxlab.bench.report import write_report
from fluxlab.config import compose


def tracking_cfg(tmp_path: Path, experiment: str = "fluxlab"):
    return compose("report", [f"tracking.tracking_uri=sqlite:///{tmp_path}/mlruns/mlflow.db",
                              f"tracking.artifact_location={(tmp_path / 'artifacts').as_uri()}",
                              f"tracking.experiment={experiment}", f"out_dir={tmp_path / 'reports'}"]).tracking


def make_sweep(tcfg, key: str, values: list, name: str, scored: bool = True, fail_last: bool = False) -> str:
    parent = tracking.start_run(tcfg, name, {tracking.SWEEP_TAG: f"{key}=...", tracking.SWEPT_KEYS_TAG: key,
                                             "command": "python -m fluxlab bench -m"})
    for i, value in enumerate(values):
        child = tracking.start_run(tcfg, f"{key}={value}", {"device": "cpu"}, parent_run_id=parent)
        failed = fail_last and i == len(values) - 1
        metrics = {} if failed else {
            "output_throughput": 100.0 * (i + 1), "tokens_per_forward": 8.0 - i, "request_throughput": 1.0,
            **{f"{s}_{lat}_ms": 10.0 * (i + 1) for s in ("median", "p90", "p99") for lat in ("e2e_latency", "ttft", "itl")},
            **({"accuracy": 0.5 + 0.1 * i} if scored else {})}
        tracking.log_run(tcfg, child, params={key: str(value), "model.name": "tiny_llada2"}, metrics=metrics)
        tracking.end_run(tcfg, child, failed=failed)
    tracking.end_run(tcfg, parent)
    return parent


def report_cfg(tmp_path: Path, selection=None):
    return compose("report", [f"tracking.tracking_uri=sqlite:///{tmp_path}/mlruns/mlflow.db",
                              f"out_dir={tmp_path / 'reports'}"] + ([f"selection={selection}"] if selection else []))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("store")
    tcfg = tracking_cfg(tmp)
    old = make_sweep(tcfg, "decoding.threshold", [0.9, 0.5, 0.7], "sweep-threshold", fail_last=True)
    new = make_sweep(tcfg, "bench.request_rate", [1, 4, 16], "sweep-rate", scored=False)
    return tmp, old, new


def test_newest_sweep_by_default_with_latency_against_request_rate(store):
    tmp, _, _ = store
    path = Path(write_report(report_cfg(tmp)))
    assert path == tmp / "reports" / "sweep-rate" / "report.md"
    text = path.read_text()
    assert "**swept**: `bench.request_rate`" in text
    assert "![Latency percentiles vs bench.request_rate](latency.png)" in text
    assert {p.name for p in path.parent.glob("*.png")} == {"throughput_tpf.png", "latency.png"}  # unscored: no accuracy


def test_parent_run_selection_sorts_by_swept_value_and_keeps_failed_jobs(store):
    tmp, old, _ = store
    path = Path(write_report(report_cfg(tmp, selection=old)))
    text = path.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| 0.")]
    assert [row.split(" | ")[0] for row in rows] == ["| 0.5", "| 0.7", "| 0.9"]
    assert "FAILED" in rows[1] and "**runs**: `3 (1 failed)`" in text
    assert (path.parent / "accuracy_tpf.png").is_file() and (path.parent / "throughput_tpf.png").is_file()
    assert path == Path(write_report(report_cfg(tmp, selection="sweep-threshold")))  # by run name too


def test_experiment_selection_reports_every_job(store):
    tmp, _, _ = store
    text = Path(write_report(report_cfg(tmp, selection="fluxlab"))).read_text()
    assert "**runs**: `6 (1 failed)`" in text


def test_unknown_selection_is_a_clear_error(store):
    tmp, _, _ = store
    with pytest.raises(ValueError, match="selection='nope'"):
        write_report(report_cfg(tmp, selection="nope"))
