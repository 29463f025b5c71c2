"""Prompt text -> token ids, one way for the server, the offline API and bench."""
from __future__ import annotations

from typing import Any

# Ling-2.0 chat format, for tokenizers that ship without a chat_template (DESIGN §4).
LING_ROLES = {"system": "SYSTEM", "developer": "SYSTEM", "user": "HUMAN", "assistant": "ASSISTANT",
              "tool": "OBSERVATION"}


def render_chat(tokenizer: Any, messages: list[dict]) -> str:
    """The prompt text of a chat: the tokenizer's own template, else the Ling-2.0 format."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = "".join(f"<role>{LING_ROLES[m['role']]}</role>{m['content']}<|role_end|>" for m in messages)
    return text + "<role>ASSISTANT</role>"


def encode_text(tokenizer: Any, text: str) -> list[int]:
    # Special tokens in the text are parsed (a pre-templated prompt keeps its role markers); a
    # literal `<|mask|>` becomes a prompt token, which the engine never decodes over.
    return tokenizer.encode(text, add_special_tokens=False)


def encode_chat(tokenizer: Any, messages: list[dict]) -> list[int]:
    return encode_text(tokenizer, render_chat(tokenizer, messages))
