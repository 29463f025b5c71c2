"""A suite of JSON schemas for structured-output tests and the json_schema bench workload: nested
objects, arrays, enums, bounded numbers, required and optional properties, strings with patterns.
Strings and arrays are bounded so a random-weight model ends them within a few blocks."""
from __future__ import annotations

NAME = {"type": "string", "pattern": "^[A-Za-z]{1,8}$"}
SCHEMAS: dict[str, dict] = {
    "flat": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
             "required": ["color"], "additionalProperties": False},
    "bool": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False},
    "integer_bounds": {"type": "object", "properties": {"n": {"type": "integer", "minimum": -50, "maximum": 50}},
                       "required": ["n"], "additionalProperties": False},
    # multipleOf bounds the digits: a greedy model may write 1.0000... to its budget for a bare "number"
    "number_bounds": {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10,
                                                             "multipleOf": 0.25}},
                      "required": ["x"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                  "b": {"type": "boolean"}},
                 "required": ["a"], "additionalProperties": False},
    "all_optional": {"type": "object", "properties": {"k": {"enum": ["x", "y"]}, "v": {"type": "boolean"}},
                     "additionalProperties": False},
    "nested": {"type": "object", "properties": {"user": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "name": NAME},
        "required": ["id", "name"], "additionalProperties": False}}, "required": ["user"], "additionalProperties": False},
    "deep": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 3}},
        "required": ["c"], "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
        "required": ["a"], "additionalProperties": False},
    "array_enum": {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                             "minItems": 1, "maxItems": 3}},
                   "required": ["tags"], "additionalProperties": False},
    "array_int": {"type": "object", "properties": {"xs": {"type": "array", "items": {
        "type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 4}}, "required": ["xs"], "additionalProperties": False},
    "array_objects": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
    "pattern_date": {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
                     "required": ["date"], "additionalProperties": False},
    "pattern_code": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-f0-9]{4}$"}},
                     "required": ["code"], "additionalProperties": False},
    "string_length": {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 6}},
                      "required": ["s"], "additionalProperties": False},
    "const": {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 9}},
              "required": ["kind", "x"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                                {"type": "boolean"}]}},
               "required": ["v"], "additionalProperties": False},
    "nullable": {"type": "object", "properties": {"v": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}},
                 "required": ["v"], "additionalProperties": False},
    "top_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
                  "maxItems": 5},
    "top_enum": {"enum": ["yes", "no", "maybe"]},
    "top_integer": {"type": "integer", "minimum": 100, "maximum": 200},
    "ref": {"type": "object", "$defs": {"pt": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
        "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
        "required": ["from", "to"], "additionalProperties": False},
    "tool_call": {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
        "type": "object", "properties": {"city": NAME, "unit": {"enum": ["c", "f"]}},
        "required": ["city"], "additionalProperties": False}}, "required": ["name", "arguments"],
        "additionalProperties": False},
}
