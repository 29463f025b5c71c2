"""`report` on a synthetic MLflow store: selection, swept-key axis, markdown table and plots."""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
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


# ---------------------------------------------------------------- a sweep's jobs against a baseline job

BASE_IDS = {0: [11, 12, 13, 14], 1: [21, 22], 2: [31, 32, 33]}  # job 0 (none): the baseline's outputs
FP8_IDS = {0: [11, 12, 99, 14], 1: [21, 22, 23], 2: [31, 32, 33]}  # job 1 (fp8): one token and one length differ


def make_quantization_sweep(tcfg, tmp_path: Path, name: str, fail_baseline: bool = False) -> str:
    """A bf16 / fp8 sweep as bench logs it: children tagged with their job number, right-answer
    counts, and requests.csv artifacts holding each prompt's output ids."""
    from fluxlab.bench.metrics import RequestRecord, records_frame

    parent = tracking.start_run(tcfg, name, {tracking.SWEEP_TAG: "model.quantization=none,fp8",
                                             tracking.SWEPT_KEYS_TAG: "model.quantization"})
    for job, (value, ids, correct) in enumerate([("none", BASE_IDS, 3), ("fp8", FP8_IDS, 2)]):
        child = tracking.start_run(tcfg, f"model.quantization={value}", {tracking.JOB_TAG: str(job)},
                                   parent_run_id=parent)
        failed = fail_baseline and job == 0
        csv = tmp_path / f"{name}-{job}" / "requests.csv"
        csv.parent.mkdir()
        records_frame([RequestRecord(index=i, success=True, output_tokens=len(t), token_ids=t)
                       for i, t in ids.items()]).to_csv(csv, index=False)
        metrics = {} if failed else {"output_throughput": 100.0 + job, "tokens_per_forward": 4.0,
                                     "correct": correct, "scored": 3, "accuracy": correct / 3}
        tracking.log_run(tcfg, child, params={"model.quantization": value, "workload.num_prompts": "3"},
                         metrics=metrics, artifacts=[] if failed else [csv])
        tracking.end_run(tcfg, child, failed=failed)
    tracking.end_run(tcfg, parent)
    return parent


@pytest.fixture(scope="module")
def quantization_store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quantization")
    tcfg = tracking_cfg(tmp)
    ok = make_quantization_sweep(tcfg, tmp, "sweep-fp8")
    failed_base = make_quantization_sweep(tcfg, tmp, "sweep-fp8-failed-baseline", fail_baseline=True)
    return tmp, ok, failed_base


def runs_table(path: str) -> pd.DataFrame:
    return pd.read_csv(Path(path).parent / "runs.csv", keep_default_na=False)


def test_token_agreement_counts_equal_positions_over_the_longer_output():
    from fluxlab.bench.compare import token_agreement

    assert token_agreement(BASE_IDS, BASE_IDS) == 1.0
    # prompt 0: 3 of 4, prompt 1: 2 of 3 (fp8's extra token disagrees), prompt 2: 3 of 3
    assert token_agreement(FP8_IDS, BASE_IDS) == pytest.approx(8 / 10)
    assert token_agreement({0: [11, 12, 13, 14]}, BASE_IDS) == pytest.approx(4 / 9)  # unanswered prompts disagree
    assert math.isnan(token_agreement({0: []}, {0: []}))


def test_bf16_and_fp8_side_by_side_with_right_answers_and_agreement_with_job_0(quantization_store):
    tmp, parent, _ = quantization_store
    path = write_report(report_cfg(tmp, selection=parent))
    table = runs_table(path)
    assert list(table["model.quantization"]) == ["none", "fp8"]  # the sweep's order: the baseline first
    assert list(table["job"]) == [0, 1] and list(table["right"]) == ["3/3", "2/3"]
    assert list(table["token_agreement"]) == [1.0, pytest.approx(0.8)]
    assert list(table["output_throughput"]) == [100.0, 101.0]
    text = Path(path).read_text()
    assert "**token agreement with**: `job 0 (model.quantization=none)`" in text
    assert "| none | 0 | FINISHED | 3/3 | 1 | 100 |" in text and "| fp8 | 1 | FINISHED | 2/3 | 0.8 | 101 |" in text


def test_baseline_key_chooses_the_job_compared_with(quantization_store):
    tmp, parent, _ = quantization_store
    cfg = report_cfg(tmp, selection=parent)
    cfg.baseline = 1
    table = runs_table(write_report(cfg))
    assert list(table["token_agreement"]) == [pytest.approx(0.8), 1.0]


@pytest.mark.parametrize("selection,baseline,message", [
    ("sweep-fp8", 5, r"baseline=5: the sweep has no job 5 \(jobs: \[0, 1\]\)"),
    ("sweep-fp8-failed-baseline", 0, r"baseline=0: that job \(FAILED\) recorded no output token ids"),
    ("fluxlab", 0, "baseline=0: a baseline is a job of a sweep"),
])
def test_a_baseline_that_cannot_be_compared_with_is_refused(quantization_store, selection, baseline, message):
    tmp, _, _ = quantization_store
    cfg = report_cfg(tmp, selection=selection)
    cfg.baseline = baseline
    with pytest.raises(ValueError, match=message):
        write_report(cfg)


def test_without_a_baseline_asked_a_failed_job_0_leaves_agreement_out(quantization_store):
    tmp, _, _ = quantization_store
    path = write_report(report_cfg(tmp, selection="sweep-fp8-failed-baseline"))
    table = runs_table(path)
    assert "token_agreement" not in table and list(table["status"]) == ["FAILED", "FINISHED"]
    assert list(table["right"]) == ["", "2/3"]
    assert "token agreement with" not in Path(path).read_text()
