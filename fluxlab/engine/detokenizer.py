"""Incremental detokenization (vLLM's prefix/read offsets): each append decodes a short window of
recent tokens, not the whole output, and holds back an unfinished UTF-8 character."""
from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0  # window start: context so the next token's text decodes right
        self.read_offset = 0  # tokens up to here are already in `text`

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, new_ids: list[int]) -> str:
        """Add tokens; returns the text they complete (may be empty while a character is unfinished)."""
        self.ids.extend(int(t) for t in new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.text += delta
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return delta
