"""The JSON of one answer, as OpenAI shapes it: the final body, the stream's chunks, the usage.

A completion and a chat completion differ only in names and in how a choice holds its text, so
each is a small subclass of `ReplyShape`.
"""
from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from fluxlab.engine.request import RequestOutput
from fluxlab.server.tool_calls import ToolCallStream, finish_reason, reply_message


@dataclass
class ReplyShape(ABC):
    request_id: str
    model: str  # the served name, whatever name the request used
    created: int
    return_token_ids: bool  # fluxlab's extension: `token_ids` on each choice
    include_usage: bool  # stream_options.include_usage: a `usage` key on every chunk, a last chunk with it

    id_prefix: ClassVar[str]
    chunk_object: ClassVar[str]
    response_object: ClassVar[str]

    @classmethod
    def of(cls, body: Any, model: str) -> "ReplyShape":
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return cls(f"{cls.id_prefix}-{uuid.uuid4().hex}", model, int(time.time()), body.return_token_ids,
                   include_usage)

    def first_chunk(self) -> Optional[dict]:
        return None

    def chunk(self, text: Optional[str], output: RequestOutput) -> Optional[dict]:
        """The stream's chunk for one committed block (None: nothing to send for it)."""
        ids = output.new_token_ids if self.return_token_ids else None
        return self._chunk([_choice(self._delta(text or ""), output.finish_reason, ids)])

    def usage_chunk(self, usage: dict) -> dict:
        return self._chunk([], usage)

    def response(self, text: str, last: RequestOutput, usage: dict) -> dict:
        ids = last.token_ids if self.return_token_ids else None
        return {"id": self.request_id, "object": self.response_object, "created": self.created, "model": self.model,
                "choices": [_choice(self._message(text), last.finish_reason, ids)], "usage": usage}

    def _chunk(self, choices: list[dict], usage: Optional[dict] = None) -> dict:
        out = {"id": self.request_id, "object": self.chunk_object, "created": self.created, "model": self.model,
               "choices": choices}
        if self.include_usage:
            out["usage"] = usage
        return out

    @abstractmethod
    def _delta(self, text: str) -> dict:
        """A streamed chunk's choice body for `text`."""

    @abstractmethod
    def _message(self, text: str) -> dict:
        """The final response's choice body for `text`."""


class CompletionShape(ReplyShape):
    id_prefix, chunk_object, response_object = "cmpl", "text_completion", "text_completion"

    def _delta(self, text: str) -> dict:
        return {"text": text, "logprobs": None}

    def _message(self, text: str) -> dict:
        return {"text": text, "logprobs": None}


@dataclass
class ChatShape(ReplyShape):
    id_prefix, chunk_object, response_object = "chatcmpl", "chat.completion.chunk", "chat.completion"
    # with tools (tool_choice not none): "auto" (text or calls) or "calls" (required / a named function)
    tools: Optional[str] = None
    tool_stream: Optional[ToolCallStream] = None

    @classmethod
    def of(cls, body: Any, model: str) -> "ChatShape":
        shape = super().of(body, model)
        if getattr(body, "calls_tools", False):
            shape.tools = "auto" if body.tool_choice_name == "auto" else "calls"
            shape.tool_stream = ToolCallStream(calls_only=shape.tools == "calls")
        return shape

    def chunk(self, text: Optional[str], output: RequestOutput) -> Optional[dict]:
        if self.tool_stream is None:
            return super().chunk(text, output)
        delta = self.tool_stream.delta(text or "", output.finished)
        ids = output.new_token_ids if self.return_token_ids else None
        if delta is None and not output.finished and not ids:
            return None  # nothing committed yet that says what the reply is
        reason = finish_reason(output.finish_reason, self.tool_stream.made_calls)
        return self._chunk([_choice({"delta": delta or {}, "logprobs": None}, reason, ids)])

    def response(self, text: str, last: RequestOutput, usage: dict) -> dict:
        if self.tools is None:
            return super().response(text, last, usage)
        message, made_calls = reply_message(text, calls_only=self.tools == "calls")
        ids = last.token_ids if self.return_token_ids else None
        choice = _choice({"message": message, "logprobs": None}, finish_reason(last.finish_reason, made_calls), ids)
        return {"id": self.request_id, "object": self.response_object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage}

    def first_chunk(self) -> Optional[dict]:
        # OpenAI's first chunk carries the role and no content
        return self._chunk([_choice({"delta": {"role": "assistant", "content": ""}, "logprobs": None}, None, None)])

    def _delta(self, text: str) -> dict:
        return {"delta": {"content": text}, "logprobs": None}

    def _message(self, text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}, "logprobs": None}


def usage(prompt_tokens: int, last: RequestOutput) -> dict:
    stats = last.stats
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(last.token_ids),
            "total_tokens": prompt_tokens + len(last.token_ids),
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
            "fluxlab": {"forwards": stats.forwards, "tokens_accepted": stats.tokens_accepted,
                        "tokens_edited": stats.tokens_edited,
                        "tokens_per_forward": round(stats.tokens_per_forward, 4),
                        "blocks": stats.blocks_committed, "preemptions": stats.preemptions,
                        "timed_out": stats.timed_out}}  # ended by server.request_timeout_s


def _choice(fields: dict, finish_reason: Optional[str], token_ids: Optional[list[int]]) -> dict:
    choice = {"index": 0, **fields, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice
