"""A served tokenizer's vocabulary as llguidance sees it (built once per tokenizer), and the one
matcher each constrained request owns.

A request's matcher always stands at the end of its committed output between steps. A step walks
it over the active block (`walk`, `advance`) and `rewind`s it after, so preemption, a failed step
retried row by row, or a block that is decoded again changes nothing; `sync` rebuilds it from the
committed output if it ever stands elsewhere (a step that raised half way)."""
from __future__ import annotations

import enum
import threading
import weakref
from typing import Any, Iterable

import numpy as np
import torch

from fluxlab.engine.constraint.grammar import Grammar


class GrammarVocab:
    """llguidance's tokenizer of one HF tokenizer with the engine's stop ids as its EOS tokens
    (`of` caches it: building one reads the whole vocabulary, ~20 ms for the tiny tokenizer, ~1 s
    for a 150k one)."""

    _cache: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, tokenizer: Any, eos_ids: Iterable[int]):
        import llguidance.hf

        self.eos_ids = tuple(sorted(set(eos_ids)))
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=list(self.eos_ids))
        self.size = self.tokenizer.vocab_size

    @classmethod
    def of(cls, tokenizer: Any, eos_ids: Iterable[int]) -> "GrammarVocab":
        key = tuple(sorted(set(eos_ids)))
        with cls._lock:
            per_tokenizer = cls._cache.setdefault(tokenizer, {})
            if key not in per_tokenizer:
                per_tokenizer[key] = cls(tokenizer, key)
            return per_tokenizer[key]


class Walk(enum.Enum):
    """Why a walk over a block stopped."""

    MASK = "mask"  # at an undecided position
    EOS = "eos"  # at an EOS the grammar accepts: the output ends there, the rest is not output
    REJECT = "reject"  # at a token the grammar refuses after the tokens before it
    END = "end"  # at the end of the positions that are output (block end or max_new_tokens)


class Constraint:
    """One request's grammar state: an llguidance matcher over its committed output."""

    def __init__(self, vocab: GrammarVocab, grammar: Grammar):
        from llguidance import LLMatcher

        self.vocab = vocab
        self.grammar = grammar
        self.matcher = LLMatcher(vocab.tokenizer, grammar.compile(), log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"invalid {grammar.kind}: {self.matcher.get_error()}")
        self._eos = np.array(vocab.eos_ids, dtype=np.int64)
        self.committed = 0  # output tokens the matcher has consumed
        self.ahead = 0  # tokens consumed past them during the current step (undone by rewind)

    # --- between steps: the committed output ---
    def sync(self, output_ids: list[int]) -> None:
        """Stand at the end of `output_ids` (tokens that passed the rule, so the grammar accepts them)."""
        self.rewind()
        if self.committed > len(output_ids):
            self.matcher.reset()
            self.committed = 0
        if self.committed < len(output_ids):
            new = [int(t) for t in output_ids[self.committed:]]
            if self.matcher.try_consume_tokens(new) != len(new):
                raise RuntimeError(f"committed output is not a prefix of the request's {self.grammar.kind}")
            self.committed = len(output_ids)

    def rewind(self) -> None:
        if self.ahead:
            self.matcher.rollback(self.ahead)
            self.ahead = 0

    # --- during a step ---
    def walk(self, tokens: np.ndarray, lo: int, hi: int, mask_id: int) -> tuple[int, Walk]:
        """Consume tokens[lo:] in position order while they are decided and valid; -> (the position it
        stopped at, why). Positions from `hi` on are not output (past max_new_tokens) and not checked."""
        seg = tokens[lo:hi]
        # the run before the first undecided position, EOS, or id only the model has (never grammar text)
        stops = np.flatnonzero((seg == mask_id) | np.isin(seg, self._eos) | (seg >= self.vocab.size))
        n = int(stops[0]) if stops.shape[0] else seg.shape[0]
        consumed = self.matcher.try_consume_tokens(seg[:n].tolist()) if n else 0
        self.ahead += consumed
        at = lo + consumed
        if consumed < n:
            return at, Walk.REJECT
        if at == hi:
            return at, Walk.END
        if seg[n] == mask_id:
            return at, Walk.MASK
        if seg[n] in self._eos and self.matcher.is_accepting():
            return at, Walk.EOS
        return at, Walk.REJECT

    def allowed(self, vocab_size: int) -> np.ndarray:
        """[vocab_size] bool: the tokens the grammar accepts next (EOS where it may end); ids past the
        tokenizer's vocabulary (a model's padding rows) never."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.zeros(vocab_size, dtype=bool)
        n = min(vocab_size, self.vocab.size)
        allowed[:n] = np.unpackbits(bits, bitorder="little")[:n].astype(bool)
        return allowed

    def allowed_tensor(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(self.allowed(vocab_size)).to(device)
