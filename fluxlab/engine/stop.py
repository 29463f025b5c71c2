"""Stop strings and final text: the engine's one use of the tokenizer after admission.

Only the newest committed block can complete a stop string, so each check searches the text from
just before the previous end (a stop string may straddle the boundary), never the whole output.
"""
from __future__ import annotations

from typing import Any

from fluxlab.engine.sequence import Request


class StopStrings:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def apply(self, request: Request) -> bool:
        """Cut request.output_ids / text at the first stop string; True when one was found.

        output_ids end with the token the stop string starts in (never before the ids already
        reported); the text ends just before it. Called after commit_block cut the block at EOS /
        max_new_tokens, so a stop string found lies before both."""
        from fluxlab.engine.detokenizer import IncrementalDetokenizer

        if request.detokenizer is None:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer)
        detok = request.detokenizer
        seen = len(detok.text)
        detok.append(request.output_ids[len(detok.token_ids):])
        text = detok.text
        longest = max(len(s) for s in request.params.stop)
        search_from = max(0, seen - longest + 1)
        hits = [(i, s) for s in request.params.stop if s and (i := text.find(s, search_from)) >= 0]
        if not hits:
            return False
        cut, _ = min(hits)
        # The shortest token prefix whose text reaches the stop string (only the newest block can).
        n = len(request.output_ids)
        for n in range(request.num_emitted, len(request.output_ids) + 1):
            if len(self._decode(request.output_ids[:n])) > cut:
                break
        request.output_ids = request.output_ids[:n]
        request.text = text[:cut]
        return True

    def final_text(self, request: Request) -> str:
        detok = request.detokenizer
        if detok is not None and detok.token_ids == request.output_ids:
            detok.finish()  # flush an unfinished character, as the full decode has it
            return detok.text
        return self._decode(request.output_ids)
