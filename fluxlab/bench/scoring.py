"""Scorers: GSM8K (the usual final-number match), arith (the embedded model's task, strict) and
json_schema (structured output: the reply validates against its schema).

The model's final number is the one after `####` or "answer is" when it says so, else the last
number in the text; the reference may be a bare number or a full GSM8K solution ending in `#### N`.
Numbers compare as values, so "1,300", "$1300" and "1300.00" all match 1300.
"""
from __future__ import annotations

import json
import re
from typing import Callable, Optional

_NUMBER = r"-?[$]?\d[\d,]*(?:\.\d+)?"
_MARKED = re.compile(rf"(?:####|answer is:?)\s*\**\s*({_NUMBER})", re.IGNORECASE)
_ANY = re.compile(_NUMBER)


def _value(token: str) -> Optional[float]:
    try:
        return float(token.replace(",", "").replace("$", ""))
    except ValueError:
        return None


def final_number(text: str) -> Optional[float]:
    """The number a GSM8K answer ends on, or None when the text holds no number."""
    marked = _MARKED.findall(text)
    if marked:
        return _value(marked[-1])
    numbers = _ANY.findall(text)
    return _value(numbers[-1]) if numbers else None


def gsm8k_correct(text: str, reference: str) -> bool:
    predicted, expected = final_number(text), final_number(reference)
    return predicted is not None and expected is not None and abs(predicted - expected) < 1e-6


_ARITH_ANSWER = re.compile(r"The answer is (\d+)\.$")


def arith_correct(text: str, reference: str) -> bool:
    """The embedded task (fluxlab/train/task.py): the reply must *end* with "The answer is N." and N
    must equal the reference; a right number anywhere else, or trailing noise, scores wrong."""
    match = _ARITH_ANSWER.search(text.strip())
    return match is not None and int(match.group(1)) == int(reference)


def json_schema_valid(text: str, schema: str) -> bool:
    """Structured output: the reply parses as JSON and validates against the schema (given as JSON text)."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), json.loads(schema))
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


SCORERS: dict[str, Callable[[str, str], bool]] = {"gsm8k": gsm8k_correct, "arith": arith_correct,
                                                  "json_schema": json_schema_valid}


def get_scorer(name: Optional[str]) -> Optional[Callable[[str, str], bool]]:
    """The scorer called `name` (workload.scorer); None when scoring is off."""
    if name is None:
        return None
    if name not in SCORERS:
        raise ValueError(f"workload.scorer={name!r}: use one of {', '.join(SCORERS)} or null")
    return SCORERS[name]
