"""The text a stream sends: incremental detokenization, holding back what a stop string may cut.

The engine cuts a stop string in the block where it completes and reports the cut text on the
finished output. A stop string can start in an earlier block, so while one may still match, the
last len(longest stop) - 1 characters are held back (as vLLM does); the chunks then always
concatenate to the non-streamed text.
"""
from __future__ import annotations

from typing import Any

from fluxlab.engine.detokenizer import IncrementalDetokenizer
from fluxlab.engine.request import RequestOutput


class StreamText:
    def __init__(self, tokenizer: Any, stop: list[str]):
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.sent = ""

    def delta(self, output: RequestOutput) -> str:
        """The new text of `output` (blocking work: call it off the event loop)."""
        if len(self.detokenizer.token_ids) + len(output.new_token_ids) != len(output.token_ids):
            # Outputs are cumulative; a gap (never seen) would corrupt the text, so start over.
            self.detokenizer = IncrementalDetokenizer(self.detokenizer.tokenizer, skip_special_tokens=True)
            self.detokenizer.append(output.token_ids)
        else:
            self.detokenizer.append(output.new_token_ids)
        if output.finished:
            self.detokenizer.finish()
            text = output.text if output.text is not None else self.detokenizer.text
        else:
            text = self.detokenizer.text
            if self.hold_back:
                text = text[:max(len(self.sent), len(text) - self.hold_back)]
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent = text if text.startswith(self.sent) else self.sent
        return delta


def final_text(tokenizer: Any, output: RequestOutput) -> str:
    """The whole text of a finished output (the engine's own, cut at a stop string, when it has one)."""
    if output.text is not None:
        return output.text
    return tokenizer.decode(output.token_ids, skip_special_tokens=True)
