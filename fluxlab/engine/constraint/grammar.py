"""What a request asks its output to match, as plain data (it crosses the engine-process boundary):
a kind and its source text. llguidance compiles it; nothing here is a hand-written JSON-schema
translator."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

# json_object: any JSON object (OpenAI's response_format {"type": "json_object"}).
GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "lark")

# Compact JSON: no whitespace between tokens. With flexible whitespace a model (a random one at
# least) may spend its whole budget on spaces and newlines that every parser ignores anyway.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Grammar:
    kind: str  # one of GRAMMAR_KINDS
    source: str = ""  # the schema as JSON text, the regex, or the Lark grammar ("" for json_object)

    @classmethod
    def json_schema(cls, schema: Any) -> "Grammar":
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    def compile(self) -> str:
        """The llguidance grammar (a JSON string) of this request; ValueError for an unknown kind or a
        schema that is not a JSON object."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if self.kind == "json_schema":
            schema = json.loads(self.source)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be a JSON object")
            return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(self.source)
        raise ValueError(f"unknown grammar kind {self.kind!r}; use one of {', '.join(GRAMMAR_KINDS)}")

    def problem(self) -> Optional[str]:
        """Why this grammar cannot be used (None when it can): a bad kind, bad JSON, an unsupported or
        invalid schema, regex or Lark text, as llguidance reports it."""
        from llguidance import LLMatcher

        if self.kind not in GRAMMAR_KINDS:
            return f"unknown grammar kind {self.kind!r}; use one of {', '.join(GRAMMAR_KINDS)}"
        if not isinstance(self.source, str):
            return f"the {self.kind} grammar must be a string"
        try:
            compiled = self.compile()
        except (ValueError, TypeError) as err:  # json.JSONDecodeError is a ValueError
            return f"invalid {self.kind}: {err}"
        error = LLMatcher.validate_grammar(compiled)
        return f"invalid {self.kind}: {error}" if error else None


def grammar_of_response_format(response_format: Any) -> Optional[Grammar]:
    """OpenAI's response_format -> the request's grammar (None for {"type": "text"}); ValueError with a
    message naming what is wrong. Types: text, json_object, json_schema ({"json_schema": {"name",
    "schema", "strict"}}: enforced whether strict or not), and fluxlab's regex ({"regex": "..."}) and
    grammar ({"grammar": "<Lark>"}) extensions."""
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise ValueError('response_format must be an object with a "type"')
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
        return Grammar.json_schema(spec.get("schema", {}))
    if kind == "regex":
        if not isinstance(response_format.get("regex"), str):
            raise ValueError('response_format regex needs {"regex": "<pattern>"}')
        return Grammar("regex", response_format["regex"])
    if kind == "grammar":
        if not isinstance(response_format.get("grammar"), str):
            raise ValueError('response_format grammar needs {"grammar": "<Lark grammar>"}')
        return Grammar("lark", response_format["grammar"])
    raise ValueError(f"response_format type {kind!r} is not supported; use text, json_object, json_schema, "
                     "regex or grammar")
