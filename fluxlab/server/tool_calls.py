"""A reply to a request with tools, as OpenAI shapes it: `message.tool_calls` and finish_reason
"tool_calls" once the reply is calls, and in a stream `delta.tool_calls` (docs/structured_output.md,
Tools).

The engine's text is in the tools grammar's form (engine/constraint/tools.py); `parse_reply` reads
it. A stream sends, per committed block: nothing while the text is still a prefix of the call
marker (under "auto" it may yet be text or calls), then either content deltas (text) or, per call,
a first delta with its index, id, type and name once the whole name is committed, and its arguments
in pieces as blocks commit them. The pieces of a call's arguments add up to the arguments string of
the non-streamed reply.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Optional

from fluxlab.engine.constraint.tools import ParsedReply, parse_reply


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(index_id: str, name: str, arguments: str) -> dict:
    return {"id": index_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def reply_message(text: str, calls_only: bool) -> tuple[dict, bool]:
    """The whole reply as a chat message -> (message, whether it is calls). A cut reply keeps the
    calls whose names are written (the last one's arguments cut, as finish_reason "length" says)."""
    parsed = parse_reply(text, finished=True, calls_only=calls_only)
    if parsed.kind == "text":
        return {"role": "assistant", "content": parsed.text}, False
    calls = [tool_call(call_id(), c.name, c.arguments) for c in parsed.calls if c.name is not None]
    return {"role": "assistant", "content": None, "tool_calls": calls}, True


@dataclass
class _SentCall:
    id: str
    arguments_sent: int = 0


@dataclass
class ToolCallStream:
    """One stream's state: what the client has been sent of the reply so far."""

    calls_only: bool  # tool_choice "required" or a named function: the reply is calls from its first character
    text: str = ""  # the reply's text so far
    sent_text: int = 0  # characters sent as content
    calls: list[_SentCall] = field(default_factory=list)
    kind: str = "undecided"

    def delta(self, text_delta: str, finished: bool) -> Optional[dict]:
        """The chat delta for the reply's next text (None: nothing to send yet)."""
        self.text += text_delta
        parsed: ParsedReply = parse_reply(self.text, finished=finished, calls_only=self.calls_only)
        self.kind = parsed.kind
        if parsed.kind == "undecided":
            return None
        if parsed.kind == "text":
            new, self.sent_text = parsed.text[self.sent_text:], len(parsed.text)
            return {"content": new} if new or finished else None
        pieces = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if index == len(self.calls):
                self.calls.append(_SentCall(call_id()))
                sent = self.calls[index]
                sent.arguments_sent = len(call.arguments)
                pieces.append({"index": index, **tool_call(sent.id, call.name, call.arguments)})
                continue
            sent = self.calls[index]
            if len(call.arguments) > sent.arguments_sent:
                pieces.append({"index": index, "function": {"arguments": call.arguments[sent.arguments_sent:]}})
                sent.arguments_sent = len(call.arguments)
        return {"tool_calls": pieces} if pieces else None

    @property
    def made_calls(self) -> bool:
        return self.kind == "calls" and bool(self.calls)


def finish_reason(reason: Optional[str], made_calls: bool) -> Optional[str]:
    """OpenAI's "tool_calls" for a reply of calls that ended where the grammar may end."""
    return "tool_calls" if reason == "stop" and made_calls else reason
