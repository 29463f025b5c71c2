"""lm-eval hooks of fluxlab_arith.yaml: the shipped split as a dataset, and fluxlab's own scorer."""
from __future__ import annotations

import json
from pathlib import Path

import datasets

from fluxlab.bench.scoring import arith_correct

SPLIT = Path(__file__).resolve().parent.parent / "arith_test.jsonl"


def load(**kwargs) -> datasets.DatasetDict:
    """The 128 problems in file order (lm-eval passes the task's metadata as keyword arguments)."""
    rows = [json.loads(line) for line in SPLIT.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"acc": float(arith_correct(results[0], doc["metadata"]["answer"]))}
