"""A checkpoint's special token ids, as the engine and the decoders use them (each family reads its own)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecialIds:
    """A checkpoint's special token ids. stop_ids: a request stops on any of them (eos first);
    delete_id/split_id: LLaDA2.2 edit tokens, None when the model has none."""

    mask_id: int
    eos_id: int
    pad_id: int
    stop_ids: tuple[int, ...]
    delete_id: int | None = None
    split_id: int | None = None


def as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
