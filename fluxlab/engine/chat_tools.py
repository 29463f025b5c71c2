"""Tools and tool turns in a chat prompt: the chat template's own rendering when it shows them, else
a documented text form (docs/structured_output.md, Tools).

Text form (the Hermes / Qwen conventions, the form tool calls are generated in):
- the tools: a system message (the first one, extended, or a new one) listing each function as a
  JSON line {"name", "description", "parameters"} and saying how to call one;
- an assistant turn's calls: `<tool_call>{"name":...,"arguments":{...}}</tool_call>` after its text;
- a tool turn: `<tool_response>CONTENT</tool_response>` as a user turn (a template that knows no
  `tool` role drops those), or in the Ling format's OBSERVATION role. Results follow the calls in
  order, as in Qwen's template; the call id is not shown.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from fluxlab.engine.constraint.tools import CALL_CLOSE, CALL_OPEN

TOOLS_PREAMBLE = ("You may call the functions below. To call functions, reply with only one "
                  f"{CALL_OPEN}{{\"name\":NAME,\"arguments\":ARGUMENTS}}{CALL_CLOSE} per call.\nFunctions:\n")


def has_tool_parts(messages: list[dict], tools: Optional[list[dict]]) -> bool:
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def renders_tool_parts(rendered: str, messages: list[dict], tools: Optional[list[dict]]) -> bool:
    """Whether a template's rendering shows every tool, every call's name and every tool result."""
    names = [t["function"]["name"] for t in tools or ()]
    names += [c["function"]["name"] for m in messages for c in m.get("tool_calls") or ()]
    results = [m["content"] for m in messages if m["role"] == "tool" and m["content"]]
    return all(piece in rendered for piece in names + results)


def tool_text_form(messages: list[dict], tools: Optional[list[dict]], tool_role: str = "user") -> list[dict]:
    """Plain role/content messages carrying the tools and tool turns as text."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "".join(CALL_OPEN + json.dumps({"name": c["function"]["name"],
                                                    "arguments": c["function"]["arguments"]},
                                                   separators=(",", ":"), ensure_ascii=False) + CALL_CLOSE
                            for c in m["tool_calls"])
            out.append({"role": m["role"], "content": (m.get("content") or "") + calls})
        elif m["role"] == "tool":
            out.append({"role": tool_role, "content": f"<tool_response>{m.get('content') or ''}</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        listing = TOOLS_PREAMBLE + "\n".join(json.dumps(_listed(t["function"]), ensure_ascii=False) for t in tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def _listed(function: dict[str, Any]) -> dict:
    return {k: function[k] for k in ("name", "description", "parameters") if function.get(k) is not None}
