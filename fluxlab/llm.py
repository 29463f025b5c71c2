"""Offline API: `LLM(model=..., overrides=[...]).generate(prompts)`, the same config as the CLI."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from omegaconf import DictConfig

from fluxlab.config import CONF_DIR, ConfigError, compose, validate_config
from fluxlab.engine.chat import encode_chat, encode_text
from fluxlab.engine.request import RequestStats, SamplingParams

Prompt = Union[str, list[int], list[dict]]


@dataclass
class GenerateResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: RequestStats


class LLM:
    def __init__(self, model: Optional[str] = None, overrides: Sequence[str] = ()):
        """model: a model group name (arith_llada2, the default; tiny_llada2, llada2_mini, ...) or a
        checkpoint folder, whose config.json picks the family's group (fluxlab/config/model_folder.py)."""
        items = list(overrides)
        if model is not None:
            items.insert(0, f"model={model}" if (CONF_DIR / "model" / f"{model}.yaml").exists() else f"model.path={model}")
        cfg = compose("generate", items)
        validate_config(cfg)  # raises ConfigError naming the keys
        self._init(cfg)

    @classmethod
    def from_config(cls, cfg: DictConfig) -> "LLM":
        """From an already validated run config (the CLI commands, bench)."""
        llm = cls.__new__(cls)
        llm._init(cfg)
        return llm

    def _init(self, cfg: DictConfig) -> None:
        from fluxlab.engine.factory import make_engine

        self.cfg = cfg
        self.engine = make_engine(cfg)
        self.tokenizer = self.engine.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        """Text, chat messages (the tokenizer's chat template) or token ids -> prompt token ids."""
        if isinstance(prompt, str):
            return encode_text(self.tokenizer, prompt)
        if prompt and isinstance(prompt[0], dict):
            return encode_chat(self.tokenizer, list(prompt))
        return [int(t) for t in prompt]

    def generate(self, prompts: Sequence[Prompt],
                 params: Union[SamplingParams, Sequence[SamplingParams], None] = None) -> list[GenerateResult]:
        """Run every prompt to completion in one continuous batch; results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        ids = [self.encode(p) for p in prompts]
        order = [self.engine.add_request(p, sp) for p, sp in zip(ids, per_prompt)]
        done = {}
        while len(done) < len(order):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [GenerateResult(p, done[rid].token_ids, done[rid].text or "", done[rid].finish_reason, done[rid].stats)
                for p, rid in zip(ids, order)]

    def shutdown(self) -> None:
        self.engine.shutdown()


__all__ = ["LLM", "GenerateResult", "SamplingParams", "ConfigError"]
