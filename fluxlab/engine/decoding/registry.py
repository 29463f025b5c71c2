"""The decoder registry: names -> decoders. Validation, SamplingParams, the server and the
reference read decoder names from here and knob ranges from knobs.py."""
from __future__ import annotations

from fluxlab.engine.decoding.base import Decoder
from fluxlab.engine.decoding.hierarchy import Hierarchy
from fluxlab.engine.decoding.joint_threshold import JointThreshold
from fluxlab.engine.decoding.knobs import KNOBS, SEED_MAX, Knob
from fluxlab.engine.decoding.levenshtein_joint import LevenshteinJoint
from fluxlab.engine.decoding.threshold import Threshold
from fluxlab.models.registry import FAMILY_DECODERS, load_class

# The block decoders, then the decoders families bring for themselves (fluxlab/models/registry.py).
DECODERS: dict[str, Decoder] = {d.name: d for d in (Threshold(), Hierarchy(), JointThreshold(), LevenshteinJoint())}
DECODERS.update({name: load_class(where)() for name, where in FAMILY_DECODERS.items()})

# Knobs every decoder reads: the proposal step samples with them.
SAMPLING_KNOBS = ("temperature", "top_p", "top_k")


def decoder_names() -> tuple[str, ...]:
    return tuple(DECODERS)


def get_decoder(name: str) -> Decoder:
    try:
        return DECODERS[name]
    except KeyError:
        raise KeyError(f"unknown decoder {name!r}; use one of {', '.join(DECODERS)}") from None


__all__ = ["DECODERS", "KNOBS", "SAMPLING_KNOBS", "SEED_MAX", "Decoder", "Knob", "decoder_names", "get_decoder"]
