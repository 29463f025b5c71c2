"""Incremental detokenization: the text of a growing token sequence, decoding only recent tokens.

vLLM's prefix/read offsets: tokens before `read_offset` already have their text in `text`; the
text of the new tokens is decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset]),
where the few tokens from `prefix_offset` give the decoder its context (a SentencePiece word
boundary, the rest of a multi-byte character). Decoding whole windows instead of single tokens is
what makes the text equal the full decode for byte-level BPE, where one character can span tokens.
A text that ends in U+FFFD is an unfinished character: those tokens wait for the next append (or
`finish`), so a delta never holds half a character. Each append costs O(new tokens + context),
not O(output), which is the point: a stream no longer re-decodes its whole output per chunk.
"""
from __future__ import annotations

from typing import Any

# Tokens of context kept before the read offset (vLLM uses 5 for the prompt's tail): enough for
# a 4-byte UTF-8 character split over byte tokens, plus one for a word-boundary space.
_CONTEXT_TOKENS = 6
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """`append(new_ids)` returns the new text; `text` is all text so far; `finish()` flushes."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # tokens before this have their text in self.text

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def append(self, new_ids: list[int]) -> str:
        """Add tokens; returns the text they complete (may be empty while a character is unfinished)."""
        self.token_ids.extend(new_ids)
        if len(self.token_ids) == self.read_offset:
            return ""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        # The longest run of new tokens whose text ends on a whole character; an unfinished one
        # spans at most a few byte tokens, so this loop runs once or a few times.
        for end in range(len(self.token_ids), self.read_offset, -1):
            window_text = self._decode(self.prefix_offset, end)
            if not window_text.endswith(_REPLACEMENT):
                return self._advance(prefix_text, window_text, end)
        return ""

    def finish(self) -> str:
        """The text of every token still held back (an unfinished character decodes as U+FFFD,
        as the full decode has it); afterwards `text` equals the full decode of `token_ids`."""
        if len(self.token_ids) == self.read_offset:
            return ""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        return self._advance(prefix_text, self._decode(self.prefix_offset, len(self.token_ids)), len(self.token_ids))

    def _advance(self, prefix_text: str, window_text: str, end: int) -> str:
        if window_text.startswith(prefix_text):
            delta = window_text[len(prefix_text):]
        else:  # a decoder whose window text is not prefix-stable: fall back to one full decode
            full = self._decode(0, end)
            delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        self.prefix_offset = max(self.prefix_offset, end - _CONTEXT_TOKENS)
        self.read_offset = end
        return delta
