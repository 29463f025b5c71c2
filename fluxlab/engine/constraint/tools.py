"""Tool calls as a grammar, and the grammar's output read back as calls (docs/structured_output.md, Tools).

One form, whatever `tool_choice` is: each call is

    <tool_call>{"name":"NAME","arguments":{...}}</tool_call>

(the Hermes / Qwen form), compact, `name` first, `arguments` valid against that tool's parameters
schema; parallel calls follow one another with nothing between. With tool_choice "auto" the output
is either such calls or plain text that does not start with `<tool_call>`: the two branches part at
the first character that differs from the marker, so the block-aware rule, which walks committed
tokens in position order, commits the output to one branch as soon as that character is decided.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from fluxlab.engine.constraint.grammar import JSON_OPTIONS, Grammar

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_NAME_KEY, _ARGUMENTS_KEY = '{"name":', ',"arguments":'


@dataclass(frozen=True)
class ToolSpec:
    """One function a request offers: its name and its parameters' JSON schema (as JSON text)."""

    name: str
    parameters: str = '{"type":"object"}'

    @classmethod
    def of(cls, name: str, parameters: Optional[dict] = None) -> "ToolSpec":
        return cls(name, json.dumps(arguments_schema(parameters)))


def arguments_schema(parameters: Optional[dict]) -> dict:
    """A tool's `parameters` as the schema of its `arguments` (an object; none given: any object);
    ValueError when it describes something else."""
    if parameters is None:
        return {"type": "object"}
    if not isinstance(parameters, dict):
        raise ValueError("parameters must be a JSON schema object")
    kind = parameters.get("type", "object")
    if kind != "object":
        raise ValueError(f'parameters must describe an object ("type": "object"), not {kind!r}')
    return {**parameters, "type": "object"}


def tool_call_grammar(tools: list[ToolSpec], choice: str, parallel: bool = True,
                      text: Optional[Grammar] = None) -> Grammar:
    """The Lark grammar of a reply to `tools`: choice "auto" (calls or text), "required" (calls), or a
    tool's name (one call of it). `parallel`: one or more calls, else exactly one. `text` is what a
    text reply must match under "auto" (json_object or json_schema; None: any text)."""
    names = [t.name for t in tools]
    if choice not in ("auto", "required") and choice not in names:
        raise ValueError(f"tool_choice names {choice!r}, which is not among the tools ({', '.join(names)})")
    offered = [t for t in tools if choice in ("auto", "required") or t.name == choice]
    lines = []
    for i, tool in enumerate(offered):
        head = f'{CALL_OPEN}{_NAME_KEY}{json.dumps(tool.name)}{_ARGUMENTS_KEY}'
        lines.append(f"call_{i}: {json.dumps(head)} args_{i} {json.dumps('}' + CALL_CLOSE)}")
        schema = {**json.loads(tool.parameters), "x-guidance": JSON_OPTIONS}
        lines.append(f"args_{i}: %json {json.dumps(schema)}")
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(offered))))
    calls = "call+" if parallel and choice in ("auto", "required") else "call"
    if choice == "auto":
        lines.append(f"start: {calls} | reply")
        lines.append(_text_rule(text))
    else:
        lines.append(f"start: {calls}")
    return Grammar("lark", "\n".join(lines) + "\n")


def _text_rule(text: Optional[Grammar]) -> str:
    if text is None:
        # any text but one that starts with the call marker (llguidance's lexeme `&` and `~`)
        return f"reply: TEXT\nTEXT: /[\\s\\S]*/ & ~/{_regex_literal(CALL_OPEN)}[\\s\\S]*/"
    if text.kind == "json_object":
        return f"reply: %json {json.dumps({'type': 'object', 'x-guidance': JSON_OPTIONS})}"
    if text.kind == "json_schema":
        return f"reply: %json {json.dumps({**json.loads(text.source), 'x-guidance': JSON_OPTIONS})}"
    raise ValueError(f"a {text.kind} response_format cannot be combined with tools (only json_object or "
                     "json_schema, or tool_choice none)")


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in "\\/.^$|?*+()[]{}" else c for c in text)


# ------------------------------------------------------------------------- reading the output back
@dataclass
class ParsedCall:
    name: Optional[str]  # None until the whole name is written
    arguments: str  # the arguments' JSON text written so far (all of it once `complete`)
    complete: bool  # the call's closing marker is written


@dataclass
class ParsedReply:
    kind: str  # "calls", "text", or "undecided" (so far a prefix of the marker: either may follow)
    text: str = ""  # the reply's text when kind is "text"
    calls: list[ParsedCall] = field(default_factory=list)  # when kind is "calls"


def parse_reply(text: str, finished: bool = True, calls_only: bool = False) -> ParsedReply:
    """What an output of `tool_call_grammar` holds so far (`finished`: it is the whole output).
    Tolerates a cut output (max_tokens, a stop string): the last call is then incomplete."""
    if not calls_only and not text.startswith(CALL_OPEN):
        if not finished and CALL_OPEN.startswith(text):
            return ParsedReply("undecided")
        return ParsedReply("text", text=text)
    calls, at = [], 0
    while text.startswith(CALL_OPEN, at):
        call, at = _parse_call(text, at + len(CALL_OPEN))
        calls.append(call)
        if not call.complete:
            break
    return ParsedReply("calls", calls=calls)


def _parse_call(text: str, at: int) -> tuple[ParsedCall, int]:
    """The call whose JSON starts at `at` -> (the call, where the text after it starts)."""
    if not text.startswith(_NAME_KEY, at):
        return ParsedCall(None, "", False), len(text)
    at += len(_NAME_KEY)
    end = _json_end(text, at)
    if end is None or not text.startswith(_ARGUMENTS_KEY, end):
        return ParsedCall(None, "", False), len(text)
    name = json.loads(text[at:end])
    at = end + len(_ARGUMENTS_KEY)
    end = _json_end(text, at)
    if end is None:
        return ParsedCall(name, text[at:], False), len(text)
    closing = "}" + CALL_CLOSE
    complete = text.startswith(closing, end)
    return ParsedCall(name, text[at:end], complete), (end + len(closing) if complete else len(text))


def _json_end(text: str, at: int) -> Optional[int]:
    """Where the JSON value (object, array or string) starting at `at` ends; None if it is cut."""
    depth, in_string, escaped = 0, False, False
    for i in range(at, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
