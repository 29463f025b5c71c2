"""Make a training run's output the shipped embedded model: `python -m fluxlab.train.ship RUN_DIR`.

Copies the checkpoint files into fluxlab/assets/arith_llada2/, the run's loss.jsonl and
train_summary.json into docs/embedded_model/, and draws docs/embedded_model/loss.png. The numbers
in docs/embedded_model.md and MIN_ACCURACY in tests/test_embedded_model.py are then re-measured
by hand (`python -m fluxlab bench -m decoding.threshold=...`).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

MODEL_FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "generation_config.json"]
RUN_FILES = ["loss.jsonl", "train_summary.json"]


def plot_loss(loss_jsonl: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in loss_jsonl.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot(steps, [r["loss"] for r in rows])
    left.set(yscale="log", xlabel="step", ylabel="loss (mean since the last point)", title="block-diffusion loss")
    right.plot(steps, [r["acc_masked"] for r in rows], label="masked tokens")
    right.plot(steps, [r["acc_corrected"] for r in rows], label="corrupted tokens")
    right.set(xlabel="step", ylabel="token accuracy (last batch)", title="token accuracy", ylim=(0.85, 1.0))
    right.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def ship(run_dir: Path, repo: Path) -> None:
    missing = [f for f in MODEL_FILES + RUN_FILES if not (run_dir / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{run_dir} lacks {', '.join(missing)} (write it with python -m fluxlab.train)")
    assets, docs = repo / "fluxlab" / "assets" / "arith_llada2", repo / "docs" / "embedded_model"
    assets.mkdir(parents=True, exist_ok=True)
    docs.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        shutil.copyfile(run_dir / name, assets / name)
    for name in RUN_FILES:
        shutil.copyfile(run_dir / name, docs / name)
    plot_loss(docs / "loss.jsonl", docs / "loss.png")


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m fluxlab.train.ship RUN_DIR  (run from the checkout's root)")
    ship(Path(sys.argv[1]), Path(__file__).resolve().parents[2])


if __name__ == "__main__":
    main()
