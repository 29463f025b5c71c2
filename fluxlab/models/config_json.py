"""config.json <-> a family's config dataclass: the dataclass's fields by name, every other key kept in
its `extra` field and written back, so a checkpoint's config survives a round trip unchanged."""
from __future__ import annotations

import dataclasses
from typing import TypeVar

C = TypeVar("C", bound="ConfigJson")


class ConfigJson:
    """Base of a family config dataclass that has an `extra: dict` field."""

    @classmethod
    def from_dict(cls: type[C], d: dict) -> C:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names}
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        d.update(self.extra)
        return d
