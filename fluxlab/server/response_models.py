"""The response bodies, for the OpenAPI document only (FastAPI's `responses=`): handlers build plain dicts
(replies.py, response_shapes.py)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from fluxlab.server.chat_messages import ToolCallFunction


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


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: Optional[str]
    tool_calls: Optional[list[ToolCallOut]] = None


class ChatChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int
    message: ChatMessageOut
    logprobs: None
    finish_reason: Optional[Literal["stop", "length", "abort", "tool_calls"]]


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
