"""A request's parameters, state and counters, and what the engine reports back about it."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

DECODERS = ("threshold", "hierarchy", "joint_threshold")


class InvalidRequest(ValueError):
    """Bad client input; `param` names the offending field (OpenAI error shape)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class EngineFatalError(RuntimeError):
    """The engine cannot go on (a tensor-parallel worker died): the server stops with this message."""


@dataclass
class SamplingParams:
    """Per-request decoding knobs. None means: take the engine's `decoding.*` / `model.*` default."""

    max_new_tokens: Optional[int] = None
    decoder: Optional[str] = None
    threshold: Optional[float] = None
    steps: Optional[int] = None
    editing_threshold: Optional[float] = None
    max_post_steps: Optional[int] = None
    low_threshold: Optional[float] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def resolve(self, decoding: Any, default_max_new_tokens: int, engine_seed: int = 0) -> "SamplingParams":
        """Fill the Nones from the engine config and check ranges; raises InvalidRequest."""
        filled = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("decoder", "threshold", "steps", "editing_threshold", "max_post_steps", "low_threshold",
                    "temperature", "top_p", "top_k"):
            if filled[key] is None:
                filled[key] = decoding[key]
        if filled["max_new_tokens"] is None:
            filled["max_new_tokens"] = default_max_new_tokens
        if filled["seed"] is None:
            filled["seed"] = engine_seed
        p = replace(self, **filled)
        block_length = decoding["block_length"]
        if p.decoder not in DECODERS:
            raise InvalidRequest(f"unknown decoder {p.decoder!r}; use one of {', '.join(DECODERS)}", "decoder")
        for key in ("threshold", "editing_threshold", "low_threshold"):
            value = getattr(p, key)
            if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise InvalidRequest(f"{key}={value} must be in [0, 1]", key)
        if not isinstance(p.steps, int) or not 1 <= p.steps <= block_length:
            raise InvalidRequest(f"steps={p.steps} must be an integer in [1, block_length={block_length}]", "steps")
        if not isinstance(p.max_new_tokens, int) or p.max_new_tokens < 1:
            raise InvalidRequest(f"max_tokens={p.max_new_tokens} must be >= 1", "max_tokens")
        if p.max_post_steps < 0:
            raise InvalidRequest(f"max_post_steps={p.max_post_steps} must be >= 0", "max_post_steps")
        if p.temperature < 0:
            raise InvalidRequest(f"temperature={p.temperature} must be >= 0", "temperature")
        if not 0.0 < p.top_p <= 1.0:
            raise InvalidRequest(f"top_p={p.top_p} must be in (0, 1]", "top_p")
        if p.top_k < 0:
            raise InvalidRequest(f"top_k={p.top_k} must be >= 0", "top_k")
        return p


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class RequestStats:
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: Optional[float] = None  # first committed block
    finish_time: Optional[float] = None
    forwards: int = 0  # forwards that computed this request's active block
    tokens_accepted: int = 0  # mask -> token transfers (edits not counted)
    blocks_committed: int = 0
    preemptions: int = 0

    @property
    def ttft_s(self) -> float:
        return (self.first_token_time or self.arrival_time) - self.arrival_time

    @property
    def latency_s(self) -> float:
        return (self.finish_time or time.perf_counter()) - self.arrival_time

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens_accepted / self.forwards if self.forwards else 0.0


@dataclass
class RequestOutput:
    """Emitted when a request commits a block or finishes. Tokens are cut at EOS / max_new_tokens / stop."""

    request_id: str
    new_token_ids: list[int]  # committed since the previous output of this request
    token_ids: list[int]  # every output token so far
    finished: bool
    finish_reason: Optional[str]  # "stop" | "length" | "abort"; None while running
    stats: RequestStats
    text: Optional[str] = None  # set on the finished output when the engine detokenizes (stop strings)


_ids = itertools.count()


def next_request_id() -> str:
    return f"req-{next(_ids)}"
