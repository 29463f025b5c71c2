"""Request prompts -> token ids, off the event loop and bounded before the work starts.

Tokenizing runs on a small thread pool (the Rust tokenizer releases the GIL), so a long prompt
never stalls /health or other streams. Text that cannot fit max_model_len is refused before it
is tokenized in full: no token decodes to more than `max_token_chars` characters, so a text
longer than max_model_len * max_token_chars needs more tokens than the context holds.
"""
from __future__ import annotations

import asyncio
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, TypeVar

from fluxlab.engine.chat import encode_chat, encode_text
from fluxlab.server.protocol import ChatCompletionRequest, ServerError
from fluxlab.server.shutdown import block_stop_signals

T = TypeVar("T")


def max_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token stands for (vocab strings are at least as long
    as their text: a byte-level symbol is one byte, `<0x41>` one byte, `▁` one space)."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # A normalizer may shrink text (NFC composes up to 3 code points into one): leave room for it.
    shrink = 1 if backend is None or backend.normalizer is None else 4
    return max(1, longest) * shrink


class PromptEncoder:
    """Prompt ids for both endpoints; every method is a coroutine whose work runs on `executor`."""

    def __init__(self, tokenizer: Any, max_model_len: int, parse_special_tokens_in_chat: bool,
                 max_workers: int = min(4, os.cpu_count() or 1)):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.parse_special_tokens_in_chat = parse_special_tokens_in_chat
        self.max_chars = max_model_len * max_token_chars(tokenizer)
        self.executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="fluxlab-tokenizer",
                                           initializer=block_stop_signals)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def completion_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            self._bound_text(len(prompt), "prompt")
            # Special tokens are parsed (a pre-templated prompt keeps its role markers); a literal
            # `<|mask|>` becomes a prompt token, which the engine never decodes over.
            ids = await self.run(_encode_checked, self.tokenizer, prompt)
        else:
            self._bound_ids(len(prompt), "prompt")
            vocab = len(self.tokenizer)
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ServerError(400, f"prompt token ids {bad[:5]} outside the vocabulary [0, {vocab})",
                                  param="prompt")
            ids = list(prompt)
        if not ids:
            raise ServerError(400, "prompt is empty", param="prompt")
        self._bound_ids(len(ids), "prompt")
        return ids

    async def chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        messages = [m.as_template_message() for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        # the tools and earlier calls are prompt text too (the template's, or chat_tools' text form)
        tool_chars = len(json.dumps(tools)) if tools else 0
        tool_chars += sum(len(json.dumps(m["tool_calls"])) for m in messages if m.get("tool_calls"))
        self._bound_text(sum(len(m["content"]) for m in messages) + tool_chars, "messages")
        ids = await self.run(_encode_chat_checked, self.tokenizer, messages, self.parse_special_tokens_in_chat, tools)
        if not ids:
            raise ServerError(400, "messages give an empty prompt", param="messages")
        self._bound_ids(len(ids), "messages")
        return ids

    def _bound_text(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise ServerError(400, f"{param} has {chars} characters, more than max_model_len={self.max_model_len} "
                                   f"tokens can hold (at most {self.max_chars} characters)", param=param)

    def _bound_ids(self, num_tokens: int, param: str) -> None:
        # The prompt needs room for at least one output token.
        if num_tokens >= self.max_model_len:
            raise ServerError(400, f"{param} is {num_tokens} tokens; max_model_len={self.max_model_len} leaves no "
                                   "room for output", param=param)


def _check_utf8(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ServerError(400, f"{param} is not valid UTF-8 (lone surrogate)", param=param)


def _encode_checked(tokenizer: Any, text: str) -> list[int]:
    _check_utf8(text, "prompt")
    return encode_text(tokenizer, text)


def _encode_chat_checked(tokenizer: Any, messages: list[dict], parse_special_tokens: bool,
                         tools: Optional[list[dict]] = None) -> list[int]:
    for message in messages:
        _check_utf8(message["content"], "messages")
    try:
        return encode_chat(tokenizer, messages, parse_special_tokens=parse_special_tokens, tools=tools)
    except Exception as err:  # noqa: BLE001 - a template refusing these messages is a client error
        raise ServerError(400, f"the chat template rejected these messages: {err}", param="messages")
