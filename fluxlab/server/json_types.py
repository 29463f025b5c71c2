"""Strict JSON numbers for request bodies: what the OpenAPI document says is what the server takes.

"0.7" as a string is a client mistake, not something to coerce silently; JSON's 1e400 parses to inf, which no
field means; 1.0 is the integer 1 (JSON Schema's `integer` is a number without a fraction).
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, StrictInt
from pydantic.types import Strict

# Strict finite numbers: "0.7" as a string is a client mistake, not something to coerce silently,
# and JSON's 1e400 parses to inf, which no knob means.
Float = Annotated[float, Strict(), Field(allow_inf_nan=False)]


def _integral(value: Any) -> Any:
    # JSON Schema's `integer` is a number without a fraction, so 1.0 is the integer 1 (and a client's
    # JSON encoder may write it so); strings and booleans stay refused.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Integer(**field: Any) -> Any:
    """A strict integer with its Field (bounds, description). The bounds sit inside the conversion so
    the document says minimum/maximum, not pydantic's own ge/le."""
    return Annotated[StrictInt, Field(**field), BeforeValidator(_integral)]


def number(kind: type, **field: Any) -> Any:
    return Annotated[Float, Field(**field)] if kind is float else Integer(**field)
