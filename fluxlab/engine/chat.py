"""Prompt text -> token ids, one way for the server, the offline API and bench."""
from __future__ import annotations

import copy
import uuid
import weakref
from typing import Any, Optional

# Ling-2.0 chat format, for tokenizers that ship without a chat_template (DESIGN §4).
LING_ROLES = {"system": "SYSTEM", "developer": "SYSTEM", "user": "HUMAN", "assistant": "ASSISTANT",
              "tool": "OBSERVATION"}


def render_chat(tokenizer: Any, messages: list[dict], tools: Optional[list[dict]] = None) -> str:
    """The prompt text of a chat: the tokenizer's own template, else the Ling-2.0 format. Tools
    (OpenAI's `tools` list), assistant tool calls and tool turns go through the template when it shows
    them, else in the text form of engine/chat_tools.py."""
    from fluxlab.engine.chat_tools import has_tool_parts, renders_tool_parts, tool_text_form

    if getattr(tokenizer, "chat_template", None):
        if has_tool_parts(messages, tools):
            native = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                   add_generation_prompt=True)
            if renders_tool_parts(native, messages, tools):
                return native
            messages = tool_text_form(messages, tools)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if has_tool_parts(messages, tools):
        messages = tool_text_form(messages, tools, tool_role="tool")  # Ling's OBSERVATION turn
    text = "".join(f"<role>{LING_ROLES[m['role']]}</role>{m['content']}<|role_end|>" for m in messages)
    return text + "<role>ASSISTANT</role>"


def encode_text(tokenizer: Any, text: str) -> list[int]:
    # Special tokens in the text are parsed (a pre-templated prompt keeps its role markers); a
    # literal `<|mask|>` becomes a prompt token, which the engine never decodes over.
    return tokenizer.encode(text, add_special_tokens=False)


def encode_chat(tokenizer: Any, messages: list[dict], parse_special_tokens: bool = False,
                tools: Optional[list[dict]] = None) -> list[int]:
    """The chat's prompt ids. Message content is text: special-token text inside it (a user typing
    `<|role_end|><role>HUMAN</role>`) is tokenized as plain characters, as with the tokenizer's
    `split_special_tokens`, so a message cannot forge turns; only the template's own markers are
    special tokens. `parse_special_tokens=True` parses them in content too (the old behaviour)."""
    if parse_special_tokens or not any(_holds_special_text(tokenizer, m.get("content")) for m in messages):
        return encode_text(tokenizer, render_chat(tokenizer, messages, tools))
    # Render with a placeholder per content, then tokenize the template's pieces with special
    # tokens and the contents as text. The check below proves the template passed every content
    # through unchanged, so the pieces are exactly the rendered prompt.
    nonce = uuid.uuid4().hex
    holders = [f"\x00fluxlab-{nonce}-{i}\x00" for i in range(len(messages))]
    pieces = render_chat(tokenizer, [{**m, "content": h} for m, h in zip(messages, holders)], tools).split("\x00")
    full = render_chat(tokenizer, messages, tools)
    ids: list[int] = []
    spliced = []
    as_text = _text_tokenizer(tokenizer)
    for piece in pieces:
        if piece.startswith(f"fluxlab-{nonce}-"):
            content = messages[int(piece.rsplit("-", 1)[1])]["content"]
            spliced.append(content)
            ids += as_text.encode(content, add_special_tokens=False, split_special_tokens=True) if content else []
        elif piece:
            spliced.append(piece)
            ids += encode_text(tokenizer, piece)
    if "".join(spliced) != full:
        raise ValueError("message content holds special-token text and the chat template changes content, "
                         "so it cannot be kept as plain text")
    return ids


def _holds_special_text(tokenizer: Any, content: Any) -> bool:
    if not isinstance(content, str) or not content:
        return False
    return any(token in content for token in _special_tokens(tokenizer))


def _special_tokens(tokenizer: Any) -> list[str]:
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    tokens = [t.content for t in decoder.values() if getattr(t, "special", False)]
    return tokens or list(getattr(tokenizer, "all_special_tokens", []))


# One copy per tokenizer with split_special_tokens on for good: toggling that flag on the shared
# tokenizer would race with other threads encoding or decoding through it.
_TEXT_TOKENIZERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _text_tokenizer(tokenizer: Any) -> Any:
    try:
        return _TEXT_TOKENIZERS[tokenizer]
    except KeyError:
        text_tokenizer = copy.deepcopy(tokenizer)
        text_tokenizer.split_special_tokens = True
        backend = getattr(text_tokenizer, "_tokenizer", None)
        if backend is not None and hasattr(backend, "encode_special_tokens"):
            backend.encode_special_tokens = True  # set now, so no encode ever flips it
        _TEXT_TOKENIZERS[tokenizer] = text_tokenizer
        return text_tokenizer
