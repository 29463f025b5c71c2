"""OpenAI request bodies (completions, chat) with fluxlab's decoding knobs, and the error shape.

Bodies accept unknown fields and ignore them (clients send `user`, ...), but a known field of the
wrong type or out of range is a 400 naming that field, and a known OpenAI field that would change
the output but is not implemented (logit_bias, tools, response_format, echo, logprobs, penalties)
is a 400 naming it, never silently dropped. Every bound is a plain JSON-schema keyword (minimum,
maximum, minItems, ...), so the OpenAPI document is what the server enforces. Range checks that
need the engine's config (steps <= block_length, prompt + max_tokens <= max_model_len) are left to
`SamplingParams.resolve` in the engine, which raises `InvalidRequest` with the same `param`.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, create_model, field_validator
from pydantic.types import Strict

from fluxlab.engine.decoding.knobs import KNOBS, SEED_MAX as _SEED_MAX, Knob
from fluxlab.engine.decoding.registry import DECODERS
from fluxlab.engine.request import SamplingParams

# Strict finite numbers: "0.7" as a string is a client mistake, not something to coerce silently,
# and JSON's 1e400 parses to inf, which no knob means.
Float = Annotated[float, Strict(), Field(allow_inf_nan=False)]
# The OpenAI/vLLM seed is a signed 64-bit integer (the engine's bound, decoding/knobs.py).
SEED_MIN, SEED_MAX = -_SEED_MAX - 1, _SEED_MAX
TokenId = Annotated[StrictInt, Field(ge=0)]


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


def _unsupported(default: Any = None, **schema: Any) -> Any:
    """A field we do not implement: documented as accepting only its default."""
    return Field(default, description="not supported: any other value is a 400", **schema)


def _knob_field(knob: Knob) -> Any:
    """A knob's body field: its type and JSON-schema bounds, as the registry writes them."""
    bounds: dict[str, Any] = {}
    if knob.minimum is not None:
        bounds["gt" if knob.exclusive_minimum else "ge"] = knob.minimum
    if knob.maximum is not None:
        bounds["le"] = knob.maximum
    kind = Float if knob.kind is float else StrictInt
    return (Optional[Annotated[kind, Field(description=knob.help or None, **bounds)]], None)


# Every decoding knob, with the bounds that need no engine config (steps <= block_length is the
# engine's check, with the same `param`).
_KnobFields = create_model("KnobFields", **{name: _knob_field(k) for name, k in KNOBS.items()})


class DecodingFields(_KnobFields):
    """Body fields shared by both endpoints. None = the server's config (decoding.*, model.*)."""

    model_config = ConfigDict(extra="ignore", strict=False)

    model: Optional[StrictStr] = None
    max_tokens: Optional[Annotated[StrictInt, Field(ge=1)]] = None
    n: Literal[1] = Field(1, description="only n=1: at temperature 0 block diffusion gives n identical answers")
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[Annotated[StrictStr, Field(min_length=1)],
                         Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(max_length=4)]]] = None
    seed: Optional[Annotated[StrictInt, Field(ge=SEED_MIN, le=SEED_MAX)]] = None
    # fluxlab extensions (DESIGN §3: per-request overrides of the decoding keys): the decoder names
    # and every knob (temperature, top_p as in OpenAI) with its range come from the decoder registry.
    decoder: Optional[Literal[tuple(DECODERS)]] = None  # type: ignore[valid-type]
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False  # adds `token_ids` to each choice
    # OpenAI fields that would change the output; not implemented, so refused unless left at the default
    logit_bias: Optional[Annotated[dict[str, Any], Field(max_length=0)]] = _unsupported()
    presence_penalty: Optional[Annotated[Float, Field(ge=0, le=0)]] = _unsupported()
    frequency_penalty: Optional[Annotated[Float, Field(ge=0, le=0)]] = _unsupported()
    repetition_penalty: Optional[Annotated[Float, Field(ge=1, le=1)]] = _unsupported()
    response_format: Optional[dict[str, Any]] = _unsupported()

    @field_validator("n", mode="before")
    @classmethod
    def _single_choice(cls, value: Any) -> Any:
        # Checked before the Literal so the message says why (and n=1.0 is not an n).
        if not isinstance(value, int) or isinstance(value, bool) or value != 1:
            raise ValueError(f"n={value!r} is not supported; only n=1")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_bounds(cls, value: Any) -> Any:
        # Before the union, so the message says what is wrong rather than which member failed.
        if isinstance(value, list) and (len(value) > 4 or any(not s for s in value)):
            raise ValueError("stop takes up to 4 non-empty strings")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: Union[None, str, list[str]]) -> Optional[list[str]]:
        if value is None:
            return None
        return [value] if isinstance(value, str) else value

    @field_validator("logit_bias", "response_format", mode="before")
    @classmethod
    def _no_objects(cls, value: Any, info) -> Any:
        if value is not None and not (info.field_name == "logit_bias" and value == {}):
            raise ValueError(f"{info.field_name} is not supported")
        return value

    @field_validator("presence_penalty", "frequency_penalty", "repetition_penalty", mode="before")
    @classmethod
    def _no_penalties(cls, value: Any, info) -> Any:
        neutral = 1 if info.field_name == "repetition_penalty" else 0
        if value is None:
            return None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != neutral:
            raise ValueError(f"{info.field_name}={value!r} is not supported (only {neutral})")
        return value  # a wrong type is left to the type check

    def sampling_params(self, max_tokens: Optional[int]) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_tokens, decoder=self.decoder, seed=self.seed,
                              stop=list(self.stop or []), ignore_eos=self.ignore_eos,
                              **{name: getattr(self, name) for name in KNOBS})


NonEmptyIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(DecodingFields):
    # A string, or token ids; a one-element list of either is accepted (what some clients send).
    prompt: Union[Annotated[StrictStr, Field(min_length=1)], NonEmptyIds,
                  Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1, max_length=1)],
                  Annotated[list[NonEmptyIds], Field(min_length=1, max_length=1)]] = Field(
        description="one prompt: text, or token ids; a list holding one of them is accepted too")
    echo: Literal[False] = _unsupported(False)
    logprobs: None = _unsupported()
    best_of: Optional[Literal[1]] = _unsupported()
    suffix: None = _unsupported()

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)) and len(value) != 1:
            raise ValueError(f"a list of {len(value)} prompts is not supported; send one prompt per request")
        if isinstance(value, (str, list)) and not value:
            raise ValueError("prompt is empty")
        return value

    @field_validator("prompt")
    @classmethod
    def _unwrap(cls, value: Any) -> Union[str, list[int]]:
        if isinstance(value, list) and isinstance(value[0], (str, list)):
            return value[0]
        return value

    @field_validator("echo", "logprobs", "best_of", "suffix", mode="before")
    @classmethod
    def _unsupported(cls, value: Any, info) -> Any:
        if not _is_default(value, {"echo": (False,), "best_of": (None, 1)}.get(info.field_name, (None,))):
            raise ValueError(f"{info.field_name} is not supported")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Optional[Union[StrictStr, list[TextPart]]] = None
    tool_calls: None = _unsupported()

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                if isinstance(part, dict) and part.get("type") not in (None, "text"):
                    raise ValueError(f"content parts of type {part.get('type')!r} are not supported; only text")
        return value

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _no_tool_calls(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("tool_calls is not supported")
        return value

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(DecodingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[Annotated[StrictInt, Field(ge=1)]] = None
    logprobs: Optional[Literal[False]] = _unsupported()
    top_logprobs: None = _unsupported()
    tools: None = _unsupported()
    tool_choice: None = _unsupported()
    functions: None = _unsupported()
    function_call: None = _unsupported()

    @field_validator("messages", mode="before")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("messages is empty")
        return value

    @field_validator("logprobs", "top_logprobs", "tools", "tool_choice", "functions", "function_call", mode="before")
    @classmethod
    def _unsupported(cls, value: Any, info) -> Any:
        if not _is_default(value, (None, False) if info.field_name == "logprobs" else (None,)):
            raise ValueError(f"{info.field_name} is not supported")
        return value


def _is_default(value: Any, defaults: tuple) -> bool:
    # `type(...) is` so that 0 is not False and True is not 1
    return any(value is d or (type(value) is type(d) and value == d) for d in defaults)


# ---------------------------------------------------------------------- responses (documentation)
# FastAPI writes these into the OpenAPI document (`responses=`); handlers build plain dicts.

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    model_config = ConfigDict(extra="allow")

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int
    text: str
    logprobs: None
    finish_reason: Optional[Literal["stop", "length", "abort"]]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int
    message: ChatMessageOut
    logprobs: None
    finish_reason: Optional[Literal["stop", "length", "abort"]]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str = Field(description="where the weights were loaded from (a local path, or the model name)")
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]
