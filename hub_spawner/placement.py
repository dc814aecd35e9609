"""Slice placement: which device a new slice goes on, and whether a change still fits.

Pure bookkeeping, no I/O. On a shared GPU (time-slicing or MPS) each slice has a
guaranteed *memory request* and a burstable *memory limit*; the GPU may hold slices
whose requests sum to at most its memory and whose limits sum to at most
``overcommit_ratio × memory`` (ratio 1.5: limits may sum to 120 GiB on an 80 GiB card,
relying on idle kernels leaving the card). A MIG instance holds one slice, whole,
with no overcommit. Compute shares are caps on each client (as NVIDIA MPS's
active-thread percentage is), not reservations, so they do not constrain placement.

Policies for shared GPUs:

- ``binpack``: the fullest GPU that still fits, so whole cards stay free for big jobs.
- ``spread``: the emptiest GPU, so users contend less.

"Fullest" compares the guarantees left first, then the budget left. Ties go to the
lower index. A slice of k cards takes its k cards in one decision, on one host: the k
fullest (binpack) or emptiest (spread) of the cards the budget and request fit on, each
holding the whole budget and request, or none at all. The allocator is used from the
Hub's single event-loop thread only; it is not thread-safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jupyter_vgpu.slice import PLACEMENTS

from .inventory import GPU
from .sizes import format_size


class PlacementError(Exception):
    """No device can take the slice; the message says, for each device, what was left.

    JupyterHub shows ``jupyterhub_message`` on the spawn page instead of a traceback.
    """

    def __init__(self, message: str):
        super().__init__(message)
        self.jupyterhub_message = message


@dataclasses.dataclass(frozen=True)
class Placement:
    """One running slice on one device, or on several cards of one host.

    Attributes:
        key: who holds it, ``"user/server name"`` (``"ada/"`` for a default server).
        gpu_uuid: the device (GPU or MIG instance); a slice of several cards, its first.
        memory_limit: the slice's budget on each card, bytes.
        compute_share: the slice's compute share, percent.
        memory_request: the slice's guaranteed bytes on each card; None means the whole
            limit.
        more_gpus: the UUIDs of its other cards (empty for one card).
    """

    key: str
    gpu_uuid: str
    memory_limit: int
    compute_share: int
    memory_request: int | None = None
    more_gpus: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.memory_request is None:
            object.__setattr__(self, "memory_request", self.memory_limit)
        object.__setattr__(self, "more_gpus", tuple(self.more_gpus))

    @property
    def gpu_uuids(self) -> tuple[str, ...]:
        """Every card of the slice, the first first."""
        return (self.gpu_uuid, *self.more_gpus)


class Allocator:
    """Tracks the slices on each device and places new ones.

    Args:
        gpus: the devices to place on (``GPUInventory.devices``); may be empty, and
            then every placement is refused with ``unavailable``.
        overcommit_ratio: limits on a shared GPU may sum to this multiple of its
            memory (>= 1).
        unavailable: why there is no device (shown when a placement is refused).

    Raises:
        ValueError: ``overcommit_ratio`` < 1.
    """

    def __init__(self, gpus: Iterable[GPU], overcommit_ratio: float = 1.0, unavailable: str | None = None):
        self.gpus = list(gpus)
        if not overcommit_ratio >= 1.0:
            raise ValueError(f"overcommit_ratio must be >= 1.0, not {overcommit_ratio!r}")
        self.overcommit_ratio = float(overcommit_ratio)
        self.unavailable = unavailable or "no GPU was found"
        self.placements: dict[str, Placement] = {}
        #: Devices that take no new slice now, and why (``{uuid: why}``: a card that no
        #: longer answers NVML); set by the Hub before each placement
        #: (:meth:`hub_spawner.config.VGPUHub.check_devices`). Slices already on them stay.
        self.down: dict[str, str] = {}

    @property
    def shared(self) -> list[GPU]:
        """The GPUs several slices share (time-slicing, MPS)."""
        return [g for g in self.gpus if not g.exclusive]

    @property
    def instances(self) -> list[GPU]:
        """The MIG instances (one slice each)."""
        return [g for g in self.gpus if g.exclusive]

    def gpu(self, uuid: str) -> GPU:
        """The device with this UUID.

        Raises:
            KeyError: no such device.
        """
        for g in self.gpus:
            if g.uuid == uuid:
                return g
        raise KeyError(uuid)

    def capacity(self, gpu: GPU) -> int:
        """Sum of limits ``gpu`` may hold, bytes: memory × overcommit ratio (× 1 for MIG)."""
        return gpu.memory if gpu.exclusive else int(gpu.memory * self.overcommit_ratio)

    def _on(self, gpu: GPU, excluding: str | None) -> list[Placement]:
        return [p for p in self.placements.values() if gpu.uuid in p.gpu_uuids and p.key != excluding]

    def committed(self, gpu: GPU, *, excluding: str | None = None) -> int:
        """Sum of the limits placed on ``gpu``, bytes (leaving out slice ``excluding``)."""
        return sum(p.memory_limit for p in self._on(gpu, excluding))

    def requested(self, gpu: GPU, *, excluding: str | None = None) -> int:
        """Sum of the requests placed on ``gpu``, bytes (leaving out slice ``excluding``)."""
        return sum(p.memory_request for p in self._on(gpu, excluding))

    def free(self, gpu: GPU, *, excluding: str | None = None) -> int:
        """Limit still placeable on ``gpu``, bytes (may be negative after a restart
        that restored more than fits)."""
        return self.capacity(gpu) - self.committed(gpu, excluding=excluding)

    def free_request(self, gpu: GPU, *, excluding: str | None = None) -> int:
        """Guarantee still placeable on ``gpu``, bytes: memory − requests."""
        return gpu.memory - self.requested(gpu, excluding=excluding)

    def largest_budget(self) -> int:
        """The largest limit any single slice may ever have, bytes: the biggest shared
        card × ratio, or the biggest MIG instance; 0 without devices."""
        return max((self.capacity(g) for g in self.gpus), default=0)

    def largest_request(self) -> int:
        """The largest request any single slice may ever have, bytes (the biggest device)."""
        return max((g.memory for g in self.gpus), default=0)

    def most_cards(self) -> int:
        """The most cards a slice may ever span: the shared GPUs of the host that has
        the most, leaving out those shared through MPS (a process reaches one card's MPS
        daemon); 0 without such a GPU."""
        hosts: dict[str | None, int] = {}
        for g in self.shared:
            if g.isolation != "mps":
                hosts[g.node] = hosts.get(g.node, 0) + 1
        return max(hosts.values(), default=0)

    def place(
        self,
        key: str,
        memory_limit: int,
        compute_share: int,
        policy: str = "binpack",
        memory_request: int | None = None,
        only=None,
    ) -> GPU:
        """Place a new one-card slice on a shared GPU (see :meth:`place_cards`).

        Returns:
            The GPU chosen.
        """
        return self.place_cards(key, memory_limit, compute_share, policy, memory_request, only)[0]

    def place_cards(
        self,
        key: str,
        memory_limit: int,
        compute_share: int,
        policy: str = "binpack",
        memory_request: int | None = None,
        only=None,
        count: int = 1,
    ) -> tuple[GPU, ...]:
        """Place a new slice on ``count`` shared GPUs of one host (replacing any earlier
        placement of ``key``), each holding the whole budget and request.

        Args:
            key: ``"user/server name"``.
            memory_limit: budget on each card, bytes (> 0).
            compute_share: percent, 1-100.
            policy: ``"binpack"`` or ``"spread"``.
            memory_request: guaranteed bytes on each card (default: the whole limit).
            only: ``GPU -> bool``, the GPUs it may go on (default: every shared GPU; on
                Slurm, those of the job's partition).
            count: cards, from 1.

        Returns:
            The GPUs chosen, lowest index first (the first is the slice's first card).

        Raises:
            ValueError: unknown policy, a request above the limit, or a count below 1.
            PlacementError: fewer than ``count`` shared GPUs of one host have the limit
                and the request free; nothing is placed.
        """
        if policy not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, not {policy!r}")
        request = memory_limit if memory_request is None else memory_request
        if request > memory_limit:
            raise ValueError(f"memory_request {request} is more than memory_limit {memory_limit}")
        if count < 1:
            raise ValueError(f"count must be at least 1, not {count}")
        if not self.gpus:
            raise PlacementError(
                f"This hub cannot place vGPU slices: {self.unavailable}. "
                "Ask an admin to check the NVIDIA driver on the Hub's host."
            )
        if not self.shared:
            raise PlacementError(
                "This hub has no shared GPU, only MIG instances: choose a MIG profile on the spawn page."
            )
        fits = [
            g
            for g in self.shared
            if self.free(g, excluding=key) >= memory_limit
            and self.free_request(g, excluding=key) >= request
            and (only is None or only(g))
            and g.uuid not in self.down
        ]
        sign = 1 if policy == "binpack" else -1

        def order(g: GPU):
            return (sign * self.free_request(g, excluding=key), sign * self.free(g, excluding=key), g.index)

        hosts: dict[str | None, list[GPU]] = {}
        for g in sorted(fits, key=order):
            hosts.setdefault(g.node, []).append(g)
        # per host, its `count` best cards; of the hosts that have enough, the best set
        sets = [cards[:count] for cards in hosts.values() if len(cards) >= count]
        if not sets:
            raise PlacementError(self._refusal(key, memory_limit, request, only, count))
        chosen = min(sets, key=lambda cards: [order(g) for g in cards])
        chosen = sorted(chosen, key=lambda g: g.index)
        self.placements[key] = Placement(
            key, chosen[0].uuid, memory_limit, compute_share, request, tuple(g.uuid for g in chosen[1:])
        )
        return tuple(chosen)

    def profiles(self, max_memory: int, *, excluding: str | None = None) -> list[dict]:
        """The MIG profiles of this hub: ``{"profile", "memory", "compute_percent",
        "total", "free", "fits"}`` each (``fits``: its memory is within ``max_memory``),
        smallest first."""
        out: dict[str, dict] = {}
        taken = {p.gpu_uuid for p in self.placements.values() if p.key != excluding}
        for g in self.instances:
            row = out.setdefault(
                g.mig_profile,
                {
                    "profile": g.mig_profile,
                    "memory": g.memory,
                    "compute_percent": g.compute_percent,
                    "total": 0,
                    "free": 0,
                    "fits": g.memory <= max_memory,
                },
            )
            row["total"] += 1
            row["free"] += g.uuid not in taken
        return sorted(out.values(), key=lambda r: (r["memory"], r["profile"]))

    def place_instance(self, key: str, profile: str | None, max_memory: int) -> GPU:
        """Give slice ``key`` a whole free MIG instance.

        Args:
            key: ``"user/server name"``.
            profile: the MIG profile asked for (``"3g.40gb"``), or None for the largest
                free instance within ``max_memory``.
            max_memory: the user's memory limit, bytes: no instance above it.

        Returns:
            The instance chosen (its memory is the slice's limit and request).

        Raises:
            PlacementError: no such profile, the profile is above ``max_memory``, or every
                instance that would do is taken.
        """
        known = {g.mig_profile for g in self.instances}
        if profile is not None and profile not in known:
            offered = ", ".join(sorted(known)) or "none"
            raise PlacementError(f"This hub has no MIG profile {profile!r}; its MIG profiles: {offered}.")
        candidates = [g for g in self.instances if profile is None or g.mig_profile == profile]
        if profile is not None and candidates[0].memory > max_memory:
            raise PlacementError(
                f"MIG profile {profile} ({format_size(candidates[0].memory)}) is more than your vGPU "
                f"quota of {format_size(max_memory)}; choose a smaller profile or ask an admin."
            )
        taken = {p.gpu_uuid for p in self.placements.values() if p.key != key}
        free = [g for g in candidates if g.memory <= max_memory and g.uuid not in taken | self.down.keys()]
        if not free:
            what = f"of profile {profile}" if profile else f"within your quota of {format_size(max_memory)}"
            down = sorted({self.down[g.uuid] for g in candidates if g.uuid in self.down})
            state = "taken or on a card that takes no slice now" if down else "taken"
            why = f": {'; '.join(down)}" if down else ""
            raise PlacementError(
                f"Every MIG instance {what} is {state} ({len(candidates)} on this hub{why}). "
                "Try again when others stop their servers, or choose another profile."
            )
        chosen = min(free, key=lambda g: (-g.memory if profile is None else 0, g.index, g.uuid))
        self.placements[key] = Placement(key, chosen.uuid, chosen.memory, chosen.compute_percent or 100)
        return chosen

    def restore(self, placement: Placement) -> None:
        """Record a slice that is already running (after a Hub restart), unchecked:
        it is on its devices whether it fits or not.

        Raises:
            KeyError: one of its devices is not in this inventory.
        """
        for uuid in placement.gpu_uuids:
            self.gpu(uuid)
        self.placements[placement.key] = placement

    def check_resize(self, key: str, memory_limit: int, memory_request: int | None = None) -> None:
        """Check that slice ``key`` may change to these sizes on its device.

        A MIG instance keeps its size whatever the quota says, so any change fits.

        Raises:
            KeyError: no slice under ``key``.
            PlacementError: the new limit or request does not fit next to the others.
        """
        current = self.placements[key]
        request = memory_limit if memory_request is None else memory_request
        for gpu in map(self.gpu, current.gpu_uuids):
            if gpu.exclusive:
                return
            if memory_limit > current.memory_limit and self.free(gpu, excluding=key) < memory_limit:
                raise PlacementError(
                    f"GPU {gpu.index} ({gpu.name}) cannot grow {key}'s slice to {format_size(memory_limit)}: "
                    f"{format_size(max(self.free(gpu, excluding=key), 0))} is left of "
                    f"{format_size(gpu.memory)} × overcommit {self.overcommit_ratio:g}"
                )
            if request > current.memory_request and self.free_request(gpu, excluding=key) < request:
                raise PlacementError(
                    f"GPU {gpu.index} ({gpu.name}) cannot guarantee {key}'s slice {format_size(request)}: "
                    f"{format_size(max(self.free_request(gpu, excluding=key), 0))} of its "
                    f"{format_size(gpu.memory)} is not yet guaranteed to others"
                )

    def resize(
        self, key: str, memory_limit: int, compute_share: int, memory_request: int | None = None
    ) -> Placement:
        """Change slice ``key`` in place (same device; a MIG instance keeps its size).

        Raises:
            KeyError: no slice under ``key``.
            PlacementError: see :meth:`check_resize`; nothing changes then.
        """
        self.check_resize(key, memory_limit, memory_request)
        current = self.placements[key]
        if self.gpu(current.gpu_uuid).exclusive:
            return current
        placement = Placement(
            key, current.gpu_uuid, memory_limit, compute_share, memory_request, current.more_gpus
        )
        self.placements[key] = placement
        return placement

    def release(self, key: str) -> None:
        """Forget slice ``key`` (no error when absent)."""
        self.placements.pop(key, None)

    def _refusal(self, key: str, memory_limit: int, request: int, only=None, count: int = 1) -> str:
        guaranteed = f" ({format_size(request)} guaranteed)" if request != memory_limit else ""
        if count == 1:
            lines = [f"No GPU has room for a {format_size(memory_limit)} vGPU slice{guaranteed}:"]
        else:
            lines = [
                f"No host has {count} GPUs with room for a vGPU slice of {format_size(memory_limit)} "
                f"on each{guaranteed}:"
            ]
        for g in self.shared:
            if only is not None and not only(g):
                continue
            if g.uuid in self.down:
                lines.append(f"{g.label} ({g.name}) takes no slice now: {self.down[g.uuid]}.")
                continue
            lines.append(
                f"{g.label} ({g.name}) has {format_size(max(self.free(g, excluding=key), 0))} left of "
                f"{format_size(g.memory)} × overcommit {self.overcommit_ratio:g}, "
                f"{format_size(max(self.free_request(g, excluding=key), 0))} of it not yet guaranteed"
                f" ({len(self._on(g, key))} slices placed)."
            )
        largest = max((g.memory for g in self.shared), default=0)
        if request > largest:
            lines.append(
                f"A guarantee of {format_size(request)} is more than any GPU's memory "
                f"({format_size(largest)}): ask an admin to set a memory_request below it."
            )
        else:
            lines.append("Ask an admin for a smaller quota, or try again when others stop their servers.")
        return " ".join(lines)
