"""A sweep's jobs against one of them, the baseline: how often each job writes the baseline's tokens
(issue 38: FP8 weights against bf16, `python -m fluxlab bench sweep=fp8`).

Token agreement of a run with the baseline, over the prompts the baseline was given: the positions
where both outputs of a prompt hold the same token, summed over prompts, over the longer output's
length summed over prompts. A length difference counts as disagreement, so 1.0 means every output
is the baseline's, token for token. Outputs are the token ids each job's requests.csv records (the
engine's, offline; the server's `token_ids`, online); a prompt a run did not answer is an empty
output. Runs given other prompts (workload.* params differ from the baseline's) are not compared.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import pandas as pd

from fluxlab.bench import tracking


def agreement(output: Sequence[int], baseline: Sequence[int]) -> tuple[int, int]:
    """(positions holding the same token, positions compared) of one prompt's two outputs: compared
    over the longer, so the shorter output's missing tail disagrees."""
    return sum(x == y for x, y in zip(output, baseline)), max(len(output), len(baseline))


def token_agreement(outputs: Mapping[int, Sequence[int]], baseline: Mapping[int, Sequence[int]]) -> float:
    """Agreement of `outputs` with `baseline` (prompt index -> output ids) over the baseline's prompts;
    NaN when no position was compared (every output empty)."""
    pairs = [agreement(outputs.get(index, ()), ids) for index, ids in baseline.items()]
    compared = sum(n for _, n in pairs)
    return sum(same for same, _ in pairs) / compared if compared else float("nan")


def output_ids(requests: pd.DataFrame) -> Optional[dict[int, list[int]]]:
    """Prompt index -> output token ids of a requests.csv; None when it has no ids (a run recorded
    before bench wrote them)."""
    if "token_ids" not in requests:
        return None
    ids = requests["token_ids"].fillna("").astype(str)
    return {int(index): [int(t) for t in text.split()] for index, text in zip(requests["index"], ids)}


def run_outputs(tracking_cfg: Any, run_id: str) -> Optional[dict[int, list[int]]]:
    """A run's output ids from its requests.csv artifact; None when it logged none."""
    client = tracking.client(tracking_cfg)
    if "requests.csv" not in {f.path for f in client.list_artifacts(run_id)}:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = client.download_artifacts(run_id, "requests.csv", tmp)
        return output_ids(pd.read_csv(Path(path), keep_default_na=False, dtype={"token_ids": str}))


def _same_prompts(run: pd.Series, base: pd.Series) -> bool:
    keys = [c for c in run.index if c.startswith("params.workload.")]
    return all(run[k] == base[k] or (pd.isna(run[k]) and pd.isna(base[k])) for k in keys)


def baseline_run(runs: pd.DataFrame, baseline: Optional[int], is_sweep: bool) -> Optional[pd.Series]:
    """The run of sweep job `baseline` (null: job 0, when the runs are a sweep's jobs); a baseline
    asked for and not found is refused, naming the jobs there are."""
    jobs = runs.get(f"tags.{tracking.JOB_TAG}")
    found = runs[jobs == str(0 if baseline is None else baseline)] if jobs is not None and is_sweep else runs.iloc[:0]
    if len(found) == 1:
        return found.iloc[0]
    if baseline is None:
        return None
    if not is_sweep:
        raise ValueError(f"baseline={baseline}: a baseline is a job of a sweep; select a sweep's parent run")
    there = sorted(int(j) for j in jobs.dropna()) if jobs is not None else []
    raise ValueError(f"baseline={baseline}: the sweep has no job {baseline} (jobs: {there or 'none recorded'})")


def agreement_column(tracking_cfg: Any, runs: pd.DataFrame, base: pd.Series, asked: bool) -> Optional[pd.Series]:
    """Each run's token agreement with `base` (NaN: failed, no ids, other prompts); None when the
    baseline has no outputs to compare with (refused when the baseline was asked for)."""
    base_ids = run_outputs(tracking_cfg, base.run_id) if base.status == "FINISHED" else None
    if base_ids is None:
        if asked:
            raise ValueError(f"baseline={base[f'tags.{tracking.JOB_TAG}']}: that job ({base.status}) recorded no "
                             f"output token ids to compare with")
        return None
    values = []
    for _, run in runs.iterrows():
        ids = run_outputs(tracking_cfg, run.run_id) if run.status == "FINISHED" and _same_prompts(run, base) else None
        values.append(float("nan") if ids is None else token_agreement(ids, base_ids))
    return pd.Series(values, index=runs.index, name="token_agreement")
