"""OpenAI request bodies (completions, chat) with fluxlab's decoding knobs, and the error shape.

Bodies accept unknown fields and ignore them (clients send `user`, ...), but a known field of the
wrong type or out of range is a 400 naming that field, and a known OpenAI field that would change
the output but is not implemented (logit_bias, functions, echo, logprobs, penalties)
is a 400 naming it, never silently dropped. Every bound is a plain JSON-schema keyword (minimum,
maximum, minItems, ...), so the OpenAPI document is what the server enforces. Rules that relate
fields, which JSON Schema cannot state (prompt + max_tokens <= max_model_len, Diffusion-Gemma's
t_max > t_min), are the engine's (`InvalidRequest` with the same `param`); schemathesis is told about
exactly those two (fluxlab/server/schemathesis_hooks.py).

The request models are built per served model (`request_models(served_fields(cfg))`): its family's
decoders and knobs are fields with their bounds, the OpenAI sampling fields it cannot vary take one
value, and another family's knobs take only null, anything else being a 400 naming them. So a LLaDA2
server's document never offers a value for `entropy_bound`, nor a Diffusion-Gemma one for `threshold`.
(They are listed, as null, because a body may carry any other name: a document silent about them
would allow every value.)
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictStr, create_model,
                      field_validator)
from pydantic.json_schema import WithJsonSchema

from fluxlab.engine.decoding.knobs import KNOBS, SEED_MAX as _SEED_MAX
from fluxlab.engine.request import SamplingParams
from fluxlab.server.chat_messages import ChatMessage, NamedToolChoice, ToolDef
from fluxlab.server.json_types import Float, Integer
from fluxlab.server.served_fields import ANY_MODEL, ServedFields, decoding_fields

# The OpenAI/vLLM seed is a signed 64-bit integer (the engine's bound, decoding/knobs.py).
SEED_MIN, SEED_MAX = -_SEED_MAX - 1, _SEED_MAX
# Documented as OpenAPI's `format: int64`, not as minimum/maximum: FastAPI writes bounds as floats,
# and 2**63 - 1 is no float (it rounds to 2**63, which the document would then allow).
Int64 = Annotated[Integer(ge=SEED_MIN, le=SEED_MAX), WithJsonSchema({"type": "integer", "format": "int64"})]


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


# response_format (docs/structured_output.md): its shape, stated in the document as a union on `type`, so
# a client (or schemathesis) sees which keys each type needs; what the document cannot state is whether
# llguidance compiles the schema, regex or Lark text (`_a_grammar`: a 400 naming response_format).
class TextFormat(BaseModel):
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    type: Literal["json_object"]


class JsonSchemaSpec(BaseModel):
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Optional[StrictStr] = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema",
                                    description="a JSON schema (none: any JSON value)")
    strict: Optional[StrictBool] = Field(None, description="ignored: the schema is always enforced")


class JsonSchemaFormat(BaseModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class RegexFormat(BaseModel):
    type: Literal["regex"]
    regex: StrictStr = Field(description="fluxlab extension: the output matches this regular expression")


class GrammarFormat(BaseModel):
    type: Literal["grammar"]
    grammar: StrictStr = Field(description="fluxlab extension: a Lark grammar (llguidance's dialect)")


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat, RegexFormat, GrammarFormat],
                           Field(discriminator="type")]


class DecodingFields(BaseModel):
    """Body fields shared by both endpoints (the decoder and its knobs are added per served model,
    `request_models`). None = the server's config (decoding.*, model.*)."""

    model_config = ConfigDict(extra="ignore", strict=False)

    model: Optional[StrictStr] = None
    max_tokens: Optional[Integer(ge=1)] = None
    n: Literal[1] = Field(1, description="only n=1: at temperature 0 block diffusion gives n identical answers")
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[Annotated[StrictStr, Field(min_length=1)],
                         Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(max_length=4)]]] = None
    seed: Optional[Int64] = None
    # fluxlab extensions (DESIGN §3: per-request overrides of the decoding keys): the decoder names
    # and every knob (temperature, top_p as in OpenAI) with its range come from the decoder registry,
    # through `request_models`.
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False  # adds `token_ids` to each choice
    # OpenAI fields that would change the output; not implemented, so refused unless left at the default
    logit_bias: Optional[Annotated[dict[str, Any], Field(max_length=0)]] = _unsupported()
    presence_penalty: Optional[Annotated[Float, Field(ge=0, le=0)]] = _unsupported()
    frequency_penalty: Optional[Annotated[Float, Field(ge=0, le=0)]] = _unsupported()
    repetition_penalty: Optional[Annotated[Float, Field(ge=1, le=1)]] = _unsupported()
    # Structured output (docs/structured_output.md): text, json_object, json_schema, and fluxlab's regex /
    # grammar (Lark) types; checked here, so a bad schema is a 400 naming response_format. The field
    # keeps the body's object (a dict): the grammar is built from it.
    response_format: Optional[ResponseFormat] = None

    @field_validator("n", mode="before")
    @classmethod
    def _single_choice(cls, value: Any) -> Any:
        # Checked before the Literal so the message says why (1.0 is 1, as in JSON Schema; true is not).
        if not _is_default(value, (1,)):
            raise ValueError(f"n={value!r} is not supported; only n=1")
        return 1

    @field_validator("stream_options", mode="before")
    @classmethod
    def _stream_options_object(cls, value: Any) -> Any:
        # pydantic's own error for a non-object here reads like the whole body is not one
        if value is not None and not isinstance(value, (dict, StreamOptions)):
            raise ValueError(f"stream_options must be an object such as {{\"include_usage\": true}}, "
                             f"not {_json_name(value)}")
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

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _no_objects(cls, value: Any, info) -> Any:
        if value is not None and value != {}:
            raise ValueError(f"{info.field_name} is not supported")
        return value

    @field_validator("response_format", mode="wrap")
    @classmethod
    def _a_grammar(cls, value: Any, handler) -> Any:
        from fluxlab.engine.constraint import grammar_of_response_format

        if value is None:
            return None
        grammar = grammar_of_response_format(value)  # ValueError: the 400's message (a missing or unknown type)
        handler(value)  # the shape the document states (json_schema's name, the types of the keys)
        problem = None if grammar is None else grammar.problem()
        if problem:
            raise ValueError(problem)
        return value

    @property
    def grammar(self):
        from fluxlab.engine.constraint import grammar_of_response_format

        return None if self.response_format is None else grammar_of_response_format(self.response_format)

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
                              stop=list(self.stop or []), ignore_eos=self.ignore_eos, grammar=self.grammar,
                              **{name: getattr(self, name) for name in KNOBS})


def _prompt_field(vocab_size: Optional[int] = None) -> Any:
    """A string, or token ids (below vocab_size); a one-element list of either is accepted (what some
    clients send)."""
    ids = Annotated[list[Integer(ge=0, **({} if vocab_size is None else {"lt": vocab_size}))], Field(min_length=1)]
    text = Annotated[StrictStr, Field(min_length=1)]
    return (Union[text, ids, Annotated[list[text], Field(min_length=1, max_length=1)],
                  Annotated[list[ids], Field(min_length=1, max_length=1)]],
            Field(description="one prompt: text, or token ids; a list holding one of them is accepted too"))


def _ids_in_vocabulary(vocab_size: Optional[int]) -> Any:
    """A validator naming the token ids out of range (the union's own error would name its first member)."""
    def check(cls, value: Any) -> Any:
        ids = value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list) else value
        if isinstance(ids, list) and ids and all(_json_kind(t) == "number" for t in ids):
            negative = [t for t in ids if t < 0]
            if negative:
                raise ValueError(f"token ids must be >= 0; got {negative[:5]}")
            bad = [t for t in ids if vocab_size is not None and t >= vocab_size]
            if bad:
                where = "[0, inf)" if vocab_size is None else f"[0, {vocab_size})"
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary {where}")
        return value

    return field_validator("prompt", mode="before")(check)


_PROMPT_TYPE, _PROMPT_FIELD = _prompt_field()


class CompletionFields(DecodingFields):
    prompt: _PROMPT_TYPE = _PROMPT_FIELD
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


class ChatFields(DecodingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[Integer(ge=1)] = None
    logprobs: Optional[Literal[False]] = _unsupported()
    top_logprobs: None = _unsupported()
    # Tool calls (docs/structured_output.md, Tools): the reply is held to a grammar built from the tools.
    tools: Optional[list[ToolDef]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = Field(
        None, validate_default=True, description='"none", "auto" (the default with tools), "required", or '
                                                 '{"type": "function", "function": {"name": ...}}')
    parallel_tool_calls: Optional[StrictBool] = Field(None, description="true (default): one or more calls; "
                                                                        "false: exactly one")
    functions: None = _unsupported()
    function_call: None = _unsupported()

    @field_validator("messages", mode="before")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("messages is empty")
        return value

    @field_validator("logprobs", "top_logprobs", "functions", "function_call", mode="before")
    @classmethod
    def _unsupported(cls, value: Any, info) -> Any:
        if not _is_default(value, (None, False) if info.field_name == "logprobs" else (None,)):
            raise ValueError(f"{info.field_name} is not supported")
        return value

    @field_validator("tools")
    @classmethod
    def _usable_tools(cls, tools: Optional[list[ToolDef]]) -> Optional[list[ToolDef]]:
        from fluxlab.engine.constraint import Grammar
        from fluxlab.engine.constraint.tools import arguments_schema

        seen: set[str] = set()
        for i, tool in enumerate(tools or ()):
            name = tool.function.name
            if name in seen:
                raise ValueError(f"tools: the function name {name!r} appears twice")
            seen.add(name)
            where = f"tools[{i}].function.parameters ({name})"
            try:
                schema = arguments_schema(tool.function.parameters)
            except ValueError as err:
                raise ValueError(f"{where}: {err}")
            problem = Grammar.json_schema(schema).problem()
            if problem:
                raise ValueError(f"{where}: {problem}")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_of_the_tools(cls, choice: Any, info) -> Any:
        # validate_default: runs also when tool_choice is absent, with the fields before it (tools,
        # response_format) in info.data. A tools error leaves `tools` out of info.data: nothing to add.
        if "tools" not in info.data:
            return choice
        tools = info.data["tools"] or []
        if choice is not None and choice != "none" and not tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not among the tools")
        return choice

    @property
    def tool_choice_name(self) -> str:
        """"none", "auto", "required", or the named function."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def tool_specs(self) -> list:
        from fluxlab.engine.constraint.tools import ToolSpec

        return [ToolSpec.of(t.function.name, t.function.parameters) for t in self.tools or ()]

    @property
    def calls_tools(self) -> bool:
        """The reply is held to the tools grammar (tools given, tool_choice other than none)."""
        return bool(self.tools) and self.tool_choice_name != "none"

    @property
    def grammar(self):
        text = DecodingFields.grammar.fget(self)
        if not self.calls_tools:
            return text
        from fluxlab.engine.constraint.tools import tool_call_grammar

        return tool_call_grammar(self.tool_specs, self.tool_choice_name, self.parallel_tool_calls is not False, text)

    def tool_problem(self) -> Optional[tuple[str, str]]:
        """(param, message) when the tools, tool_choice and response_format cannot make one grammar."""
        if not self.calls_tools:
            return None
        try:
            grammar = self.grammar
        except ValueError as err:
            return "response_format", str(err)
        problem = grammar.problem()
        return ("tools", problem) if problem else None


def request_models(served: ServedFields) -> tuple[type[CompletionFields], type[ChatFields]]:
    """The completion and chat request models of a served model (named as in its OpenAPI document)."""
    completion = decoding_fields(served)
    completion["__validators__"]["_ids_in_vocabulary"] = _ids_in_vocabulary(served.vocab_size)
    return (create_model("CompletionRequest", __base__=CompletionFields, prompt=_prompt_field(served.vocab_size),
                         **completion),
            create_model("ChatCompletionRequest", __base__=ChatFields, **decoding_fields(served)))


CompletionRequest, ChatCompletionRequest = request_models(ANY_MODEL)


def _is_default(value: Any, defaults: tuple) -> bool:
    # JSON Schema's equality: 0 is not false and true is not 1, but 1.0 is 1
    return any(value is d or (_json_kind(value) == _json_kind(d) and value == d) for d in defaults)


def _json_kind(value: Any) -> Any:
    return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value)


def _json_name(value: Any) -> str:
    """The JSON type of a parsed value, as a client wrote it."""
    for kind, name in ((bool, "a boolean"), (str, "a string"), (list, "an array"), ((int, float), "a number")):
        if isinstance(value, kind):
            return name
    return type(value).__name__
