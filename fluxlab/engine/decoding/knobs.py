"""Per-request decoding knobs: each one's name, type and range, written once.

Config validation (`decoding.<name>`), SamplingParams (per request), the server's body fields and the
reference generate all check values through `KNOBS`, so a range lives in exactly one place.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional


@dataclass(frozen=True)
class Knob:
    name: str
    kind: type  # float or int
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    exclusive_minimum: bool = False
    up_to_block_length: bool = False  # maximum is the run's decoding.block_length
    optional: bool = False  # None is allowed: the checkpoint's generation_config.json value
    help: str = ""

    def bounds(self, block_length: Optional[int] = None) -> tuple[Optional[float], Optional[float]]:
        maximum = block_length if self.up_to_block_length else self.maximum
        return self.minimum, maximum

    def problem(self, value: Any, block_length: Optional[int] = None, prefix: str = "") -> Optional[str]:
        """Why `value` is not allowed (None when it is): the message names the knob (and
        block_length where it bounds it), each behind `prefix` ("decoding." for config keys)."""
        low, high = self.bounds(block_length)
        if value is None and self.optional:
            return None
        if self.kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                return f"{prefix}{self.name}={value!r} must be an integer"
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{prefix}{self.name}={value!r} must be a finite number"
        lo_ok = low is None or (value > low if self.exclusive_minimum else value >= low)
        hi_ok = high is None or value <= high
        if lo_ok and hi_ok:
            return None
        left = "(" if self.exclusive_minimum else "["
        if self.up_to_block_length:
            right = f"{prefix}block_length={block_length}]"
        else:
            right = "inf)" if high is None else f"{high:g}]" if self.kind is float else f"{high}]"
        return f"{prefix}{self.name}={value!r} must be in {left}{low:g}, {right}"


# Integer knobs end up in device tensors (the canvas schedule's step count is an int32 tensor, as in
# transformers; seat tables are int64): a larger value would fail the step, not the request.
INT32_MAX = 2**31 - 1
MAX_DENOISING_STEPS = 256

KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("threshold", float, 0.0, 1.0, help="accept masked positions whose confidence is above this"),
    Knob("low_threshold", float, 0.0, 1.0, help="hierarchy: a masked run's best position is accepted above this"),
    Knob("editing_threshold", float, 0.0, 1.0,
         help="editing decoders: rewrite a token when the new argmax's confidence is above this (0 = whenever it differs)"),
    Knob("steps", int, 1, up_to_block_length=True, help="transfer-schedule steps per block"),
    Knob("max_post_steps", int, 0, INT32_MAX, help="editing decoders: forwards allowed on a block without masks"),
    Knob("temperature", float, 0.0, help="0 = greedy"),
    Knob("top_p", float, 0.0, 1.0, exclusive_minimum=True),
    Knob("top_k", int, 0, INT32_MAX, help="0 = off"),
    Knob("max_steps_per_block", int, 2, INT32_MAX,
         help="levenshtein_joint: hard cap on forwards per block (a final round, then the commit)"),
    # Diffusion-Gemma's canvas decoder (decoding/canvas.py); null = the checkpoint's generation_config.json.
    # A compute budget, not only a range: without an early stop a canvas runs all N forwards, so a
    # request could hold its seat for hours. 256 is 5x transformers' default (48) and one forward per
    # position of the published 256-token canvas.
    Knob("max_denoising_steps", int, 1, MAX_DENOISING_STEPS, optional=True,
         help="canvas: denoising steps per canvas (N of the schedule)"),
    Knob("entropy_bound", float, 0.0, exclusive_minimum=True, optional=True,
         help="canvas: accept the lowest-entropy positions while their entropy sum minus the largest stays <= this"),
    Knob("t_min", float, 0.0, optional=True, help="canvas: temperature at the last denoising step"),
    # > 0 outright: it must exceed t_min >= 0 (transformers' rule), and the document can say that much
    Knob("t_max", float, 0.0, exclusive_minimum=True, optional=True,
         help="canvas: temperature at the first denoising step (> t_min)"),
    Knob("stability_threshold", int, 0, INT32_MAX, optional=True,
         help="canvas: early stop needs the argmax canvas unchanged over this many steps"),
    Knob("confidence_threshold", float, 0.0, exclusive_minimum=True, optional=True,
         help="canvas: early stop needs the mean entropy below this"),
)}

# Knobs whose value multiplies a request's forwards, each with a server-side ceiling: the decoding key
# `<knob>_limit`, null = the run's own default of the knob (decoding.<knob>, else the checkpoint's
# generation_config.json), so by default a request may ask for less work than the default, never more.
# The other knobs are bounded by their ranges: `steps` by block_length; a block's mask-filling forwards
# by block_length (every block decoder fills at least one mask a forward, and levenshtein_joint's edits
# that add masks stop at max_steps_per_block); the canvas' early stop (stability_threshold,
# confidence_threshold) only ends a canvas before its max_denoising_steps; top_k only narrows a draw.
# max_tokens is bounded by model.max_model_len. server.request_timeout_s bounds the rest (time on a seat).
LIMIT_KEYS = {"max_post_steps": "max_post_steps_limit", "max_steps_per_block": "max_steps_per_block_limit",
              "max_denoising_steps": "max_denoising_steps_limit"}  # knob -> the decoding key of its ceiling


def work_ceilings(decoding: Any, checkpoint: Optional[dict] = None, knobs: Iterable[str] = tuple(LIMIT_KEYS)
                  ) -> dict[str, int]:
    """knob -> the most a request may ask for, for each LIMITED_KNOB among `knobs` (those the model
    reads) the run has a value for: decoding.<knob>_limit, else decoding.<knob>, else `checkpoint`'s
    (generation_config.json). Raises ValueError when the default a request takes by leaving the knob
    unset is above its ceiling."""
    checkpoint = checkpoint or {}
    ceilings = {}
    for name in (k for k in LIMIT_KEYS if k in knobs):
        default, source = decoding.get(name), f"decoding.{name}"
        if default is None:
            default, source = checkpoint.get(name), f"the checkpoint's {name} (generation_config.json)"
        limit = decoding.get(LIMIT_KEYS[name])
        if limit is None:
            if default is not None:
                ceilings[name] = int(default)
            continue
        if default is not None and default > limit:
            raise ValueError(f"decoding.{LIMIT_KEYS[name]}={limit} is below {source}={default}, the value of every "
                             f"request that leaves {name} unset; raise the limit or lower the default")
        ceilings[name] = int(limit)
    return ceilings


def above_ceiling(name: str, value: Any, ceiling: Optional[int]) -> Optional[str]:
    """Why `value` asks for too much work (None when it does not, or has no number to compare)."""
    if ceiling is None or isinstance(value, bool) or not isinstance(value, (int, float)) or value <= ceiling:
        return None
    return f"{name}={value!r} is above its ceiling {ceiling} (decoding.{LIMIT_KEYS[name]})"


# torch.Generator.manual_seed takes [-2**63, 2**64 - 1]; requests take the signed int64 range (the
# server's bound too), so a seed never overflows inside a step.
SEED_MAX = 2**63 - 1
