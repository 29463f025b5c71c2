"""A request's parameters, state and counters, and what the engine reports back about it."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from fluxlab.engine.constraint import Grammar

class InvalidRequest(ValueError):
    """Bad client input; `param` names the offending field (OpenAI error shape)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # the server's engine process sends it back whole
        return type(self), (str(self), self.param)


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
    max_steps_per_block: Optional[int] = None
    low_threshold: Optional[float] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    max_denoising_steps: Optional[int] = None  # canvas decoder (Diffusion-Gemma); None after resolve =
    entropy_bound: Optional[float] = None  # the checkpoint's generation_config.json (the canvas engine fills it)
    t_min: Optional[float] = None
    t_max: Optional[float] = None
    stability_threshold: Optional[int] = None
    confidence_threshold: Optional[float] = None
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # Structured output (docs/structured_output.md): every committed prefix stays a valid prefix of it.
    grammar: Optional["Grammar"] = None

    def resolve(self, decoding: Any, default_max_new_tokens: int, engine_seed: int = 0) -> "SamplingParams":
        """Fill the Nones from the engine config and check every value; raises InvalidRequest
        naming the field. Names and ranges come from the decoder registry (decoding/knobs.py)."""
        from fluxlab.engine.decoding.registry import DECODERS, KNOBS, SEED_MAX

        filled = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("decoder", *KNOBS):
            if key in filled and filled[key] is None:
                filled[key] = decoding[key]
        if filled["max_new_tokens"] is None:
            filled["max_new_tokens"] = default_max_new_tokens
        if filled["seed"] is None:
            filled["seed"] = engine_seed
        p = replace(self, **filled)
        if p.decoder not in DECODERS:
            raise InvalidRequest(f"unknown decoder {p.decoder!r}; use one of {', '.join(DECODERS)}", "decoder")
        block_length = decoding["block_length"]
        for knob in KNOBS.values():
            if not hasattr(p, knob.name):
                continue
            problem = knob.problem(getattr(p, knob.name), block_length)
            if problem:
                raise InvalidRequest(problem, knob.name)
        if DECODERS[p.decoder].greedy_only and p.temperature > 0:
            raise InvalidRequest(f"temperature={p.temperature} must be 0 for decoder={p.decoder} (greedy only)",
                                 "temperature")
        if isinstance(p.max_new_tokens, bool) or not isinstance(p.max_new_tokens, int) or p.max_new_tokens < 1:
            raise InvalidRequest(f"max_tokens={p.max_new_tokens} must be an integer >= 1", "max_tokens")
        if isinstance(p.seed, bool) or not isinstance(p.seed, int) or not -SEED_MAX - 1 <= p.seed <= SEED_MAX:
            raise InvalidRequest(f"seed={p.seed} must be an integer in [-2**63, 2**63 - 1]", "seed")
        if p.grammar is not None:
            check_grammar(p)
        return p

    @property
    def effective_steps(self) -> int:
        """Transfer-schedule steps per block: min(steps, max_new_tokens) (published LLaDA2.0 rule)."""
        return min(self.steps, self.max_new_tokens)


def check_grammar(p: SamplingParams) -> None:
    """A grammar the engine can hold, on a decoder it can constrain; InvalidRequest names `grammar`."""
    from fluxlab.engine.constraint import Grammar

    if not isinstance(p.grammar, Grammar):
        raise InvalidRequest(f"grammar={p.grammar!r} must be a fluxlab Grammar", "grammar")
    if p.ignore_eos:
        raise InvalidRequest("ignore_eos cannot be combined with a grammar: EOS is where the grammar may end",
                             "ignore_eos")
    problem = p.grammar.problem()
    if problem:
        raise InvalidRequest(problem, "grammar")


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
    tokens_edited: int = 0  # token -> token edits (editing decoders)
    blocks_committed: int = 0
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache at admission
    admitted_time: Optional[float] = None  # first took a seat: server.request_timeout_s counts from here
    timed_out: bool = False  # ended by server.request_timeout_s with the tokens it had (finish_reason "length")

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
    finish_reason: Optional[str]  # "stop" | "length" | "abort" | "error"; None while running
    stats: RequestStats
    text: Optional[str] = None  # the finished output's text
    error: Optional[str] = None  # finish_reason "error": why the engine could not run this request


_ids = itertools.count()


def next_request_id() -> str:
    return f"req-{next(_ids)}"
