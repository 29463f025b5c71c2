"""What a reference generate returns (reference.py for LLaDA2.0/2.1, reference_llada22.py for LLaDA2.2)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ReferenceOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" (an EOS was generated) or "length"
    forwards: int
    # per decoded block: how many positions each forward filled (mask -> token), for tests/stats
    accepted_per_step: list[list[int]] = field(default_factory=list)
    edits: int = 0  # joint_threshold / levenshtein_joint token-to-token edits applied
    scan_edits: int = 0  # levenshtein_joint: DELETE and SPLIT tokens consumed by the edit scan
    canvas: list[int] = field(default_factory=list)  # final prompt + blocks (mask ids where never decoded)
