"""Slice placement: which GPU a new slice goes on, and whether a change still fits.

Pure bookkeeping, no I/O. Each GPU may hold slices whose budgets sum to at most
``overcommit_ratio × memory`` (ratio 1.0: never more than the card; 1.5: budgets may
sum to 120 GiB on an 80 GiB card, relying on idle tensors being offloaded). Compute
shares are caps on each client (as NVIDIA MPS's active-thread percentage is), not
reservations, so they do not constrain placement.

Policies:

- ``binpack``: the fullest GPU that still fits, so whole cards stay free for big jobs.
- ``spread``: the emptiest GPU, so users contend less.

Ties go to the lower index. The allocator is used from the Hub's single event-loop
thread only; it is not thread-safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jupyter_vgpu.slice import PLACEMENTS

from .inventory import GPU
from .sizes import format_size


class PlacementError(Exception):
    """No GPU can take the slice; the message says, for each GPU, what was left.

    JupyterHub shows ``jupyterhub_message`` on the spawn page instead of a traceback.
    """

    def __init__(self, message: str):
        super().__init__(message)
        self.jupyterhub_message = message


@dataclasses.dataclass(frozen=True)
class Placement:
    """One running slice on one GPU.

    Attributes:
        key: who holds it, ``"user/server name"`` (``"ada/"`` for a default server).
        gpu_uuid: the GPU.
        memory_limit: the slice's budget, bytes.
        compute_share: the slice's compute share, percent.
    """

    key: str
    gpu_uuid: str
    memory_limit: int
    compute_share: int


class Allocator:
    """Tracks the slices on each GPU and places new ones.

    Args:
        gpus: the GPUs to place on (from :class:`hub_spawner.inventory.GPUInventory`).
        overcommit_ratio: budgets on a GPU may sum to this multiple of its memory (>= 1).

    Raises:
        ValueError: ``overcommit_ratio`` < 1 or no GPU given.
    """

    def __init__(self, gpus: Iterable[GPU], overcommit_ratio: float = 1.0):
        self.gpus = list(gpus)
        if not self.gpus:
            raise ValueError("an allocator needs at least one GPU")
        if not overcommit_ratio >= 1.0:
            raise ValueError(f"overcommit_ratio must be >= 1.0, not {overcommit_ratio!r}")
        self.overcommit_ratio = float(overcommit_ratio)
        self.placements: dict[str, Placement] = {}

    def gpu(self, uuid: str) -> GPU:
        """The GPU with this UUID. Raises KeyError when unknown."""
        for g in self.gpus:
            if g.uuid == uuid:
                return g
        raise KeyError(uuid)

    def capacity(self, gpu: GPU) -> int:
        """Sum of budgets ``gpu`` may hold, bytes: memory × overcommit ratio."""
        return int(gpu.memory * self.overcommit_ratio)

    def committed(self, gpu: GPU, *, excluding: str | None = None) -> int:
        """Sum of the budgets placed on ``gpu``, bytes (leaving out slice ``excluding``)."""
        return sum(
            p.memory_limit for p in self.placements.values() if p.gpu_uuid == gpu.uuid and p.key != excluding
        )

    def free(self, gpu: GPU, *, excluding: str | None = None) -> int:
        """Budget still placeable on ``gpu``, bytes (may be negative after a restart
        that restored more than fits)."""
        return self.capacity(gpu) - self.committed(gpu, excluding=excluding)

    def largest_budget(self) -> int:
        """The largest budget any single slice may ever have: the biggest card × ratio."""
        return max(self.capacity(g) for g in self.gpus)

    def place(self, key: str, memory_limit: int, compute_share: int, policy: str = "binpack") -> GPU:
        """Place a new slice (replacing any earlier placement under ``key``).

        Args:
            key: ``"user/server name"``.
            memory_limit: budget, bytes (> 0).
            compute_share: percent, 1-100.
            policy: ``"binpack"`` or ``"spread"``.

        Returns:
            The GPU chosen.

        Raises:
            ValueError: unknown policy.
            PlacementError: no GPU has ``memory_limit`` free.
        """
        if policy not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, not {policy!r}")
        fits = [g for g in self.gpus if self.free(g, excluding=key) >= memory_limit]
        if not fits:
            raise PlacementError(self._refusal(key, memory_limit))
        if policy == "binpack":
            chosen = min(fits, key=lambda g: (self.free(g, excluding=key), g.index))
        else:
            chosen = min(fits, key=lambda g: (-self.free(g, excluding=key), g.index))
        self.placements[key] = Placement(key, chosen.uuid, memory_limit, compute_share)
        return chosen

    def restore(self, placement: Placement) -> None:
        """Record a slice that is already running (after a Hub restart), unchecked:
        it is on the GPU whether it fits or not.

        Raises:
            KeyError: the GPU is not in this inventory.
        """
        self.gpu(placement.gpu_uuid)
        self.placements[placement.key] = placement

    def check_resize(self, key: str, memory_limit: int) -> None:
        """Check that slice ``key`` may change to ``memory_limit`` bytes on its GPU.

        Raises:
            KeyError: no slice under ``key``.
            PlacementError: the new budget does not fit next to the others.
        """
        current = self.placements[key]
        gpu = self.gpu(current.gpu_uuid)
        if memory_limit > current.memory_limit and self.free(gpu, excluding=key) < memory_limit:
            raise PlacementError(
                f"GPU {gpu.index} ({gpu.name}) cannot grow {key}'s slice to {format_size(memory_limit)}: "
                f"{format_size(max(self.free(gpu, excluding=key), 0))} is left of "
                f"{format_size(gpu.memory)} × overcommit {self.overcommit_ratio:g}"
            )

    def resize(self, key: str, memory_limit: int, compute_share: int) -> Placement:
        """Change slice ``key`` in place (same GPU).

        Raises:
            KeyError: no slice under ``key``.
            PlacementError: see :meth:`check_resize`; nothing changes then.
        """
        self.check_resize(key, memory_limit)
        placement = dataclasses.replace(
            self.placements[key], memory_limit=memory_limit, compute_share=compute_share
        )
        self.placements[key] = placement
        return placement

    def release(self, key: str) -> None:
        """Forget slice ``key`` (no error when absent)."""
        self.placements.pop(key, None)

    def _refusal(self, key: str, memory_limit: int) -> str:
        lines = [f"No GPU has room for a {format_size(memory_limit)} vGPU slice:"]
        for g in self.gpus:
            lines.append(
                f"GPU {g.index} ({g.name}) has {format_size(max(self.free(g, excluding=key), 0))} left of "
                f"{format_size(g.memory)} × overcommit {self.overcommit_ratio:g}"
                f" ({sum(1 for p in self.placements.values() if p.gpu_uuid == g.uuid and p.key != key)}"
                " slices placed)."
            )
        lines.append("Ask an admin for a smaller quota, or try again when others stop their servers.")
        return " ".join(lines)
