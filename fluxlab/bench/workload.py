"""Benchmark workloads: chat-prompt JSONL files (GSM8K shape) and random token prompts.

A workload is a list of `BenchPrompt`s, the same for online and offline mode, so both send the
engine identical inputs: chat messages go through the same chat template on either side, random
prompts are token ids.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import DictConfig


@dataclass
class BenchPrompt:
    index: int
    max_tokens: int
    messages: Optional[list[dict]] = None  # chat prompt (jsonl workloads)
    token_ids: Optional[list[int]] = None  # raw prompt (random workload)
    answer: Optional[str] = None  # reference answer; scored when present
    ignore_eos: bool = False  # random: generate exactly max_tokens, as sglang's random dataset does
    metadata: dict[str, Any] = field(default_factory=dict)


def sample_jsonl_path() -> Path:
    """The GSM8K-style sample shipped with fluxlab (prompts + reference answers)."""
    return Path(str(resources.files("fluxlab") / "assets" / "gsm8k_sample.jsonl"))


def _pick_length(bounds: Sequence[int], rng: random.Random, key: str) -> int:
    if len(bounds) == 1:
        return int(bounds[0])
    if len(bounds) == 2 and 1 <= bounds[0] <= bounds[1]:
        return rng.randint(int(bounds[0]), int(bounds[1]))
    raise ValueError(f"workload.{key}={list(bounds)}: use [fixed] or [low, high] with 1 <= low <= high")


def load_jsonl(path: Path, num_prompts: Optional[int], max_tokens: Optional[int]) -> list[BenchPrompt]:
    """The first `num_prompts` lines (cycled when the file is shorter; None: every line), in file order.

    File order (no shuffle) keeps the prompts of two runs identical whatever their seeds.
    `max_tokens` replaces each line's own max_tokens (the dataset's 2048 is far too long for smoke runs).
    """
    if not path.is_file():
        raise FileNotFoundError(f"workload.path={path}: no such file")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"workload.path={path}: no prompts in the file")
    prompts = []
    for index in range(len(lines) if num_prompts is None else num_prompts):
        item = lines[index % len(lines)]
        if not isinstance(item.get("messages"), list):
            raise ValueError(f"workload.path={path} line {index % len(lines) + 1}: needs a 'messages' list")
        metadata = item.get("metadata") or {}
        answer = metadata.get("answer")
        prompts.append(BenchPrompt(
            index=index, messages=item["messages"],
            max_tokens=int(max_tokens if max_tokens is not None else item.get("max_tokens") or 128),
            answer=None if answer is None else str(answer), metadata=metadata))
    return prompts


def random_prompts(tokenizer: Any, num_prompts: int, seed: int, input_len: Sequence[int],
                   output_len: Sequence[int]) -> list[BenchPrompt]:
    """Prompts of uniformly random ordinary token ids (special tokens excluded, so no <|mask|> or EOS)."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    prompts = []
    for index in range(num_prompts):
        n_in = _pick_length(input_len, rng, "input_len")
        n_out = _pick_length(output_len, rng, "output_len")
        prompts.append(BenchPrompt(index=index, token_ids=[rng.choice(vocab) for _ in range(n_in)],
                                   max_tokens=n_out, ignore_eos=True))
    return prompts


def load_workload(cfg: DictConfig, tokenizer: Any = None) -> list[BenchPrompt]:
    """The prompts of `cfg.workload`; `tokenizer` is needed for kind=random only.

    When workload.max_tokens is null, jsonl prompts take model.max_new_tokens (the server's default
    generation length) instead of the file's own value.
    """
    wl = cfg.workload
    if wl.num_prompts is not None and wl.num_prompts < 1:
        raise ValueError(f"workload.num_prompts={wl.num_prompts} must be >= 1 (or null: every prompt of the file)")
    if wl.kind == "jsonl":
        path = Path(wl.path) if wl.path else sample_jsonl_path()
        max_tokens = wl.max_tokens if wl.max_tokens is not None else cfg.model.max_new_tokens
        return load_jsonl(path, wl.num_prompts, max_tokens)
    if wl.kind == "random":
        if tokenizer is None:
            raise ValueError("workload.kind=random needs the model's tokenizer")
        if wl.num_prompts is None:
            raise ValueError("workload.kind=random needs workload.num_prompts (a number)")
        output_len = [wl.max_tokens] if wl.max_tokens is not None else list(wl.output_len)
        return random_prompts(tokenizer, wl.num_prompts, wl.seed, list(wl.input_len), output_len)
    raise ValueError(f"workload.kind={wl.kind!r}: use jsonl or random")
