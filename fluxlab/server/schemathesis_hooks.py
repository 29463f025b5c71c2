"""Schemathesis hooks: the rules of fluxlab's request bodies that JSON Schema cannot state.

    SCHEMATHESIS_HOOKS=fluxlab.server.schemathesis_hooks schemathesis run http://HOST:PORT/openapi.json

The OpenAPI document bounds every field alone. Two rules relate fields, and a schema cannot say them:
- the prompt's tokens + max_tokens must fit max_model_len (OpenAI and vLLM refuse it too; the
  prompt's length is known only once it is tokenized);
- Diffusion-Gemma: t_max > t_min (transformers' rule), a field left out being the checkpoint's value.
Nor can it say what makes a grammar usable (docs/structured_output.md): a `response_format` schema,
regex or Lark text llguidance compiles (the document states response_format's shape, a union on
`type`, so a missing or unknown type or a missing key is a finding), a tool's `parameters` that is a
JSON schema of an object, tool names that differ, a `tool_choice` that names one of the tools (or
comes with tools at all), a regex or Lark response_format beside tools.
So a body the document allows can get a 400, and schemathesis' positive_data_acceptance check (ST202)
reports it. This hook drops exactly those reports: an ST202 whose 400 names one of these rules.
Every other check, and every other ST202, stays; schemathesis counts the dropped ones in its summary.
"""
from __future__ import annotations

from typing import Any

import schemathesis

# (param, words of the message) of the 400s that are the cross-field rules: fluxlab/engine (the
# context check), fluxlab/server/prompts.py (a prompt longer than the context), the canvas engine.
CROSS_FIELD_RULES = (("max_tokens", "max_model_len"), ("prompt", "max_model_len"), ("messages", "max_model_len"),
                     ("t_max", "t_min"),
                     # grammars (fluxlab/engine/constraint: grammar.py's messages, protocol.py's tool checks)
                     ("response_format", "invalid "), ("response_format", "cannot be combined with tools"),
                     ("tools", "function.parameters"), ("tools", "appears twice"),
                     ("tool_choice", "needs tools"), ("tool_choice", "not among the tools"))


@schemathesis.hook
def filter_failure(context: Any, failure: Any, case: Any, response: Any) -> bool:
    """False (drop it) for an ST202 that is one of the cross-field rules; True keeps the failure."""
    if getattr(failure, "code", None) != "ST202" or response.status_code != 400:
        return True
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return True
    return not any(error.get("param") == param and words in str(error.get("message"))
                   for param, words in CROSS_FIELD_RULES)
