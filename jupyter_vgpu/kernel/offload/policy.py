"""Which storages to offload first: least recently used, then largest."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Candidate:
    """A storage the policy may offload.

    Attributes:
        key: its storage key (see ``reach.storage_key``).
        nbytes: its size, bytes.
        last_used: monotonic seconds when a cell last mentioned a name reaching it.
    """

    key: tuple
    nbytes: int
    last_used: float


def order(candidates: list[Candidate], *, now: float, idle_seconds: float | None) -> list[Candidate]:
    """Candidates to offload, in order: idle ones only (unless ``idle_seconds`` is None),
    least recently used first, the largest first among equals."""
    chosen = [c for c in candidates if idle_seconds is None or now - c.last_used >= idle_seconds]
    return sorted(chosen, key=lambda c: (c.last_used, -c.nbytes))
