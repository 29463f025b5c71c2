"""Benchmark workloads: chat-prompt JSONL files (GSM8K shape), random token prompts, and two
shared-prefix workloads for the prefix cache: GSM8K few-shot (the same k exemplars before every
question) and a multi-turn chat replay (each turn's prompt is the previous turns and answers).

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
    response_format: Optional[dict] = None  # json_schema: the OpenAI response_format the request carries
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


def _read_lines(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"workload.path={path}: no such file")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for number, item in enumerate(lines, 1):
        if not isinstance(item.get("messages"), list) or not item["messages"]:
            raise ValueError(f"workload.path={path} line {number}: needs a 'messages' list")
    if not lines:
        raise ValueError(f"workload.path={path}: no prompts in the file")
    return lines


def _worked_answer(item: dict) -> dict:
    """An exemplar's assistant turn: the line's own solution when it has one, else its final answer."""
    metadata = item.get("metadata") or {}
    if metadata.get("solution"):
        content = str(metadata["solution"])
    elif metadata.get("answer") is not None:
        content = f"The answer is {metadata['answer']}."
    else:
        raise ValueError("a few-shot exemplar needs metadata.answer (or metadata.solution)")
    return {"role": "assistant", "content": content}


def fewshot_prompts(path: Path, num_prompts: Optional[int], num_shots: int, max_tokens: int) -> list[BenchPrompt]:
    """GSM8K k-shot: the file's first `num_shots` lines (question, answer) as user/assistant turns
    before each question of the following lines (cycled; None: each once), so every prompt shares
    those turns."""
    lines = _read_lines(path)
    if not 0 <= num_shots < len(lines):
        raise ValueError(f"workload.num_shots={num_shots} must be in [0, lines in workload.path - 1 = {len(lines) - 1}]")
    shots = [turn for item in lines[:num_shots] for turn in (item["messages"][0], _worked_answer(item))]
    questions = lines[num_shots:]
    prompts = []
    for index in range(len(questions) if num_prompts is None else num_prompts):
        item = questions[index % len(questions)]
        metadata = item.get("metadata") or {}
        answer = metadata.get("answer")
        prompts.append(BenchPrompt(index=index, messages=shots + [item["messages"][0]], max_tokens=max_tokens,
                                   answer=None if answer is None else str(answer), metadata=metadata))
    return prompts


def multiturn_prompts(path: Path, num_prompts: Optional[int], num_turns: int, max_tokens: int) -> list[BenchPrompt]:
    """A chat replay: conversations of `num_turns` user turns, each answered by its recorded answer;
    turn t's prompt is turns 1..t-1 with their answers plus turn t, so it extends turn t-1's prompt.
    A line with several messages is one conversation (user, assistant, user, ...); single-message
    lines (the GSM8K sample) are chained, `num_turns` consecutive lines a conversation. Prompts are
    in turn-major order (every conversation's turn 1, then turn 2, ...): with limited concurrency a
    turn usually starts after the previous one finished, as in a chat."""
    lines = _read_lines(path)
    if num_turns < 1:
        raise ValueError(f"workload.num_turns={num_turns} must be >= 1")
    conversations = []
    if any(len(item["messages"]) > 1 for item in lines):
        for item in lines:
            conversations.append(list(item["messages"]))
    else:
        for start in range(0, len(lines) - num_turns + 1, num_turns):
            turns = []
            for item in lines[start:start + num_turns]:
                turns += [item["messages"][0], _worked_answer(item)]
            conversations.append(turns[:-1])
    if not conversations:
        raise ValueError(f"workload.path={path}: fewer than workload.num_turns={num_turns} lines")
    if num_prompts is None:  # every conversation once, each of its turns
        num_conversations, num_prompts = len(conversations), len(conversations) * num_turns
    else:
        num_conversations = -(-num_prompts // num_turns)
    prompts = []
    for turn in range(num_turns):
        for c in range(num_conversations):
            messages = conversations[c % len(conversations)]
            user_turns = [i for i, m in enumerate(messages) if m.get("role") == "user"]
            if turn >= len(user_turns) or len(prompts) == num_prompts:
                continue
            prompts.append(BenchPrompt(index=len(prompts), messages=messages[:user_turns[turn] + 1],
                                       max_tokens=max_tokens, metadata={"conversation": c, "turn": turn}))
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


def json_schema_prompts(num_prompts: Optional[int], max_tokens: int, constrained: bool) -> list[BenchPrompt]:
    """Structured output: the schema suite (engine/constraint/schemas.py) cycled, one chat prompt each
    asking for JSON that matches it. The answer is the schema (scorer json_schema: the reply parses and
    validates); constrained=false sends the same prompts without response_format (the baseline)."""
    from fluxlab.engine.constraint.schemas import SCHEMAS

    names = list(SCHEMAS)
    prompts = []
    for index in range(len(names) if num_prompts is None else num_prompts):
        name = names[index % len(names)]
        schema = SCHEMAS[name]
        text = f"Reply with JSON only, matching this JSON schema: {json.dumps(schema)}"
        response_format = ({"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
                           if constrained else None)
        prompts.append(BenchPrompt(index=index, max_tokens=max_tokens, messages=[{"role": "user", "content": text}],
                                   answer=json.dumps(schema), response_format=response_format,
                                   metadata={"schema": name}))
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
    if wl.kind in ("fewshot", "multiturn"):
        path = Path(wl.path) if wl.path else sample_jsonl_path()
        max_tokens = wl.max_tokens if wl.max_tokens is not None else cfg.model.max_new_tokens
        if wl.kind == "fewshot":
            return fewshot_prompts(path, wl.num_prompts, wl.num_shots, max_tokens)
        return multiturn_prompts(path, wl.num_prompts, wl.num_turns, max_tokens)
    if wl.kind == "random":
        if tokenizer is None:
            raise ValueError("workload.kind=random needs the model's tokenizer")
        if wl.num_prompts is None:
            raise ValueError("workload.kind=random needs workload.num_prompts (a number)")
        output_len = [wl.max_tokens] if wl.max_tokens is not None else list(wl.output_len)
        return random_prompts(tokenizer, wl.num_prompts, wl.seed, list(wl.input_len), output_len)
    if wl.kind == "json_schema":
        max_tokens = wl.max_tokens if wl.max_tokens is not None else cfg.model.max_new_tokens
        return json_schema_prompts(wl.num_prompts, max_tokens, wl.constrained)
    raise ValueError(f"workload.kind={wl.kind!r}: use jsonl, fewshot, multiturn, random or json_schema")
