"""OpenAI request bodies (completions, chat) with fluxlab's decoding knobs, and the error shape.

Bodies accept unknown fields and ignore them (clients send `user`, `presence_penalty`, ...), but a
known field of the wrong type or out of range is a 400 naming that field. Range checks that need
the engine's config (steps <= block_length, prompt + max_tokens <= max_model_len) are left to
`SamplingParams.resolve` in the engine, which raises `InvalidRequest` with the same `param`.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from fluxlab.engine.request import SamplingParams

# Strict numbers: "0.7" as a string is a client mistake, not something to coerce silently.
Float = Union[StrictInt, float]


class ServerError(Exception):
    """An HTTP error in the OpenAI shape; raised anywhere in a handler, rendered by app.py."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_body(message: str, type: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class DecodingFields(BaseModel):
    """Body fields shared by both endpoints. None = the server's config (decoding.*, model.*)."""

    model_config = ConfigDict(extra="ignore", strict=False)

    model: Optional[str] = None
    max_tokens: Optional[StrictInt] = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[StrictInt] = None
    temperature: Optional[Float] = Field(default=None, ge=0)
    top_p: Optional[Float] = Field(default=None, gt=0, le=1)
    # fluxlab extensions (DESIGN §3: per-request overrides of the decoding keys)
    top_k: Optional[StrictInt] = Field(default=None, ge=0)
    decoder: Optional[str] = None
    threshold: Optional[Float] = Field(default=None, ge=0, le=1)
    editing_threshold: Optional[Float] = Field(default=None, ge=0, le=1)
    low_threshold: Optional[Float] = Field(default=None, ge=0, le=1)
    steps: Optional[StrictInt] = Field(default=None, ge=1)
    max_post_steps: Optional[StrictInt] = Field(default=None, ge=0)
    max_steps_per_block: Optional[StrictInt] = Field(default=None, ge=2)
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False  # adds `token_ids` to each choice

    @field_validator("max_tokens")
    @classmethod
    def _positive_max_tokens(cls, value: Optional[int]) -> Optional[int]:
        if value is not None and value < 1:
            raise ValueError(f"max_tokens={value} must be >= 1")
        return value

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int) -> int:
        # Block diffusion at temperature 0 gives n identical answers; n > 1 is not worth a batch slot.
        if value != 1:
            raise ValueError(f"n={value} is not supported; only n=1")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: Union[None, str, list[str]]) -> Optional[list[str]]:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    def sampling_params(self, max_tokens: Optional[int]) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_tokens, decoder=self.decoder, threshold=self.threshold, steps=self.steps,
            editing_threshold=self.editing_threshold, max_post_steps=self.max_post_steps,
            max_steps_per_block=self.max_steps_per_block,
            low_threshold=self.low_threshold, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, seed=self.seed, stop=list(self.stop or []), ignore_eos=self.ignore_eos)


class CompletionRequest(DecodingFields):
    # A string, or token ids; a one-element list of either is accepted (what some clients send).
    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    echo: StrictBool = False
    logprobs: Optional[StrictInt] = None
    best_of: Optional[StrictInt] = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Union[str, list[int]]:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError(f"a list of {len(value)} prompts is not supported; send one prompt per request")
            value = value[0]
        if not value:
            raise ValueError("prompt is empty")
        return value

    @field_validator("echo", "logprobs", "best_of")
    @classmethod
    def _unsupported(cls, value: Any, info) -> Any:
        if value not in (None, False, 1) or (info.field_name == "logprobs" and value is not None):
            raise ValueError(f"{info.field_name} is not supported")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ServerError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(DecodingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictBool] = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages is empty")
        return value

    @field_validator("max_completion_tokens")
    @classmethod
    def _positive(cls, value: Optional[int]) -> Optional[int]:
        if value is not None and value < 1:
            raise ValueError(f"max_completion_tokens={value} must be >= 1")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: Optional[bool]) -> Optional[bool]:
        if value:
            raise ValueError("logprobs is not supported")
        return value
