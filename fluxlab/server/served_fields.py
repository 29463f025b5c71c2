"""The decoding fields of one served model's request bodies: its family's decoders and knobs with their
bounds, the OpenAI sampling fields it cannot vary (one value), and other families' knobs (null only).

`request_models(served_fields(cfg))` (protocol.py) turns them into the completion and chat request models,
and so into the server's OpenAPI document.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from pydantic import Field, field_validator

from fluxlab.engine.decoding.knobs import KNOBS, Knob, above_ceiling, work_ceilings
from fluxlab.engine.decoding.registry import DECODERS
from fluxlab.models.registry import FAMILY_KNOBS, family_of_model
from fluxlab.server.json_types import number


@dataclass(frozen=True)
class ServedFields:
    """The decoding fields of one served model's bodies (`served_fields`): they become its request
    models and so its OpenAPI document."""

    decoders: tuple[str, ...]  # the `decoder` values it runs
    knobs: tuple[str, ...]  # knobs it reads, with the registry's bounds
    pinned: dict[str, tuple[Any, str]] = field(default_factory=dict)  # knob -> (its one value, why)
    refused: dict[str, str] = field(default_factory=dict)  # knob it does not read -> the 400's message
    block_length: Optional[int] = None  # the bound of `steps` (None: the engine checks it)
    vocab_size: Optional[int] = None  # the bound of a prompt's token ids (None: the server checks it)
    ceilings: dict[str, int] = field(default_factory=dict)  # knob -> its work ceiling (decoding.<knob>_limit)


# The OpenAI sampling fields the canvas decoder cannot vary (it has its own temperature schedule).
CANVAS_PINNED = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}


def _decodes_canvases(model: Any) -> bool:
    return family_of_model(model).canvas


def served_knobs(model: Any) -> tuple[str, ...]:
    """The knobs a request to this model may carry: its family's own (registry), and the ones it takes at one value."""
    family = family_of_model(model)
    if family.canvas:
        return (*family.knobs, *CANVAS_PINNED)
    return tuple(k for k in KNOBS if k not in FAMILY_KNOBS)


def served_fields(cfg: Any, vocab_size: Optional[int] = None) -> ServedFields:
    """What the model of `cfg` takes per request (`served_knobs`, its decoders, their bounds)."""
    name, knobs = cfg.model.name, served_knobs(cfg.model)
    if _decodes_canvases(cfg.model):
        why = "the canvas decoder samples with its own temperature schedule (t_min, t_max); leave it unset"
        pinned = {k: (value, why) for k, value in CANVAS_PINNED.items()}
        own = tuple(k for k in knobs if k not in pinned)
        refused = {k: f"{k} is not a Diffusion-Gemma knob: {name} decodes with decoder=canvas, whose knobs are "
                      f"{', '.join(own)}" for k in KNOBS if k not in knobs}
        return ServedFields(("canvas",), own, pinned, refused, vocab_size=vocab_size,
                            ceilings=work_ceilings(cfg.decoding, _checkpoint_knobs(cfg.model), own))
    refused = {k: f"{k} is a canvas-decoder knob (Diffusion-Gemma); {name} does not read it"
               for k in KNOBS if k not in knobs}
    return ServedFields(_runnable_decoders(cfg), knobs, refused=refused, block_length=cfg.decoding.block_length,
                        vocab_size=vocab_size, ceilings=work_ceilings(cfg.decoding, knobs=knobs))


def _checkpoint_knobs(model: Any) -> dict:
    """A Diffusion-Gemma checkpoint's own knob values (generation_config.json): the defaults, and so
    the work ceilings, of the engine that serves it (CanvasEngine.generation_defaults)."""
    return family_of_model(model).hooks().generation_defaults(model)


def _runnable_decoders(cfg: Any) -> tuple[str, ...]:
    """The block decoders whose special tokens the model has (levenshtein_joint needs LLaDA2.2's
    delete and split ids): the rule of the engine's `_missing_special_ids`, on the same ids."""
    from fluxlab.engine.loading import resolve_model_dir

    try:
        model_dir = resolve_model_dir(cfg.model)
    except ValueError:
        model_dir = None  # random weights without files: the preset says
    family = family_of_model(cfg.model)
    special = family.hooks().special_ids(model_dir, preset=cfg.model.preset)
    return tuple(name for name, decoder in DECODERS.items()
                 if not family.refuses(name)
                 and all(getattr(special, i) is not None for i in decoder.special_ids))


# Every decoder and knob, no served model's limits: the models a config-free caller validates with.
ANY_MODEL = ServedFields(tuple(DECODERS), tuple(KNOBS))


def _knob_field(knob: Knob, block_length: Optional[int], ceiling: Optional[int] = None) -> Any:
    """A knob's body field: its type and JSON-schema bounds, as the registry writes them, the
    maximum lowered to the served model's work ceiling."""
    bounds: dict[str, Any] = {}
    if knob.minimum is not None:
        bounds["gt" if knob.exclusive_minimum else "ge"] = knob.minimum
    maximum = block_length if knob.up_to_block_length else knob.maximum
    if ceiling is not None:
        maximum = ceiling if maximum is None else min(maximum, ceiling)
    if maximum is not None:
        bounds["le"] = maximum
    return (Optional[number(knob.kind, description=knob.help or None, **bounds)], None)


def _pinned_field(knob: Knob, value: Any, why: str) -> Any:
    return (Optional[number(knob.kind, ge=value, le=value)], Field(None, description=f"only {value}: {why}"))


def decoding_fields(served: ServedFields) -> dict[str, Any]:
    """create_model fields and validators of `served`'s decoder and knobs."""
    fields: dict[str, Any] = {"decoder": (Optional[Literal[served.decoders]], None)}
    for name, knob in KNOBS.items():
        if name in served.pinned:
            fields[name] = _pinned_field(knob, *served.pinned[name])
        elif name in served.knobs:
            fields[name] = _knob_field(knob, served.block_length, served.ceilings.get(name))
        else:  # another family's: documented as null only (bodies may carry any other name), refused below
            why = served.refused.get(name, f"{name} is not supported")
            fields[name] = (None, Field(None, description=f"{why}: only null"))

    def refuse(cls, value: Any, info) -> Any:
        if value is not None:
            raise ValueError(served.refused.get(info.field_name, f"{info.field_name} is not supported"))
        return value

    def pin(cls, value: Any, info) -> Any:
        one, why = served.pinned[info.field_name]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != one:
            raise ValueError(f"{info.field_name}={value!r}: {why}")
        return value  # a wrong type is left to the type check

    def under_ceiling(cls, value: Any, info) -> Any:
        # before the `maximum` check, so the 400 names the key that sets the ceiling
        problem = above_ceiling(info.field_name, value, served.ceilings[info.field_name])
        if problem:
            raise ValueError(problem)
        return value

    validators = {}
    limited = tuple(n for n in served.ceilings if n in served.knobs)
    if limited:
        validators["_work_ceilings"] = field_validator(*limited, mode="before")(under_ceiling)
    others = tuple(n for n in KNOBS if n not in served.knobs and n not in served.pinned)
    if others:
        validators["_refuse_other_knobs"] = field_validator(*others, mode="before")(refuse)
    if served.pinned:
        validators["_pinned_knobs"] = field_validator(*served.pinned, mode="before")(pin)
    return {"__validators__": validators, **fields}
