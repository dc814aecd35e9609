"""The vGPU slice: the one contract between the Hub, the user's server and its kernels.

A :class:`Slice` is a small frozen record: which GPU, how many bytes of its memory the
user may hold (the *budget*, or memory limit) and how many are guaranteed (the *memory
request*), which percentage of its compute (the *compute share*), the user's
*priority*, the *isolation backend*, and the policy the kernel follows when the card is
short of memory. The Hub creates it at spawn time, serialises it once with
:meth:`Slice.to_json`, and hands it to the single-user server in the
``JUPYTER_VGPU_SLICE`` environment variable. The server and the kernels parse it with
:meth:`Slice.from_json` and nothing else: nothing downstream re-derives a slice.

The serialised form is the contract ``slice`` (``jupyter_vgpu/contracts/slice.schema.json``,
version 3). A slice may span several cards of one host (``more_gpus``): the budget,
request and compute share then hold on each card. Version-2 documents (one card) are
still read, and version-1 documents (no request, priority or isolation) too: their
request is their limit, their priority :data:`DEFAULT_PRIORITY`, their isolation
``"time-slicing"``. Kernels parse slices without jsonschema (importing it costs about a
second), so :meth:`Slice.__post_init__` checks every field the way the schema does;
``tests/unit/test_contracts.py`` proves that the two agree.

This module is pure Python (no torch, no jupyterhub) so that every side may import it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

#: Environment variable carrying the serialised slice from the spawner to the server.
SLICE_ENV = "JUPYTER_VGPU_SLICE"

#: Placement policies the Hub knows (see ``hub_spawner.placement``).
PLACEMENTS = ("binpack", "spread")

#: Isolation backends: how the GPU is shared (see :func:`compute_share_text`).
ISOLATIONS = ("time-slicing", "mps", "mig")

#: Priorities run from :data:`MIN_PRIORITY` to :data:`MAX_PRIORITY`; higher wins.
MIN_PRIORITY, MAX_PRIORITY, DEFAULT_PRIORITY = 0, 100, 50

#: Version of the serialised form; bumped when a field changes meaning.
SCHEMA_VERSION = 3

#: Most cards one slice may span (its first card and up to this many minus one more).
MAX_GPUS = 16

#: Largest byte count any contract carries (a signed 64-bit integer).
MAX_BYTES = 2**63 - 1

_V1_FIELDS = (
    "gpu_uuid",
    "gpu_index",
    "gpu_name",
    "gpu_memory",
    "memory_limit",
    "compute_share",
    "placement",
    "overcommit_ratio",
    "simulated",
    "idle_seconds",
    "high_watermark",
)


class SliceError(ValueError):
    """A serialised slice is malformed or one of its fields is out of range."""


def compute_share_text(isolation: str, compute_share: int, mig_profile: str | None = None) -> str:
    """What a compute share means under ``isolation``, for people to read.

    ``"not enforced (time-sliced)"`` under time-slicing (nothing holds a kernel to
    its share); ``"50% under MPS, not enforced (set in the server's environment)"``
    under MPS: MPS holds a client to ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` from its own
    environment, which only lowers the daemon's limit (NVIDIA's MPS documentation,
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), and a process of the user's that clears it
    gets the daemon's: the largest share of the card's ``mps`` slices where the node
    arbiter runs the daemon (:func:`jupyter_vgpu.node.mps.ceiling`), the card's, not the
    slice's; ``"MIG instance 3g.40gb (hardware partition)"`` under MIG.

    Raises:
        SliceError: unknown ``isolation``.
    """
    if isolation == "time-slicing":
        return "not enforced (time-sliced)"
    if isolation == "mps":
        return f"{compute_share}% under MPS, not enforced (set in the server's environment)"
    if isolation == "mig":
        return f"MIG instance{f' {mig_profile}' if mig_profile else ''} (hardware partition)"
    raise SliceError(f"isolation must be one of {', '.join(ISOLATIONS)}, not {isolation!r}")


@dataclasses.dataclass(frozen=True)
class Card:
    """One more card of a slice that spans several (:attr:`Slice.more_gpus`).

    Attributes:
        uuid: NVML UUID of the GPU (``GPU-…``; ``GPU-sim-…`` when simulated).
        index: NVML index of the GPU on the host (0-based).
        memory: Total memory of the GPU, bytes.

    Raises:
        SliceError: a field is out of range (on construction).
    """

    uuid: str
    index: int
    memory: int

    def __post_init__(self) -> None:
        _check(
            isinstance(self.uuid, str) and 0 < len(self.uuid) <= 128,
            "more_gpus: uuid must be a non-empty string of at most 128 characters",
        )
        _check(_is_int(self.index) and 0 <= self.index <= 4096, "more_gpus: index must be an integer 0-4096")
        _check(
            _is_int(self.memory) and 0 < self.memory <= MAX_BYTES,
            "more_gpus: memory must be a positive number of bytes",
        )

    @classmethod
    def from_dict(cls, data: object) -> Card:
        """Parse ``{"uuid": str, "index": int, "memory": int}``.

        Raises:
            SliceError: not an object, a field missing or unknown, or out of range.
        """
        if not isinstance(data, Mapping):
            raise SliceError(f"more_gpus: each card must be a JSON object, not {type(data).__name__}")
        if set(data) != {"uuid", "index", "memory"}:
            raise SliceError("more_gpus: each card has exactly the fields uuid, index and memory")
        return cls(data["uuid"], data["index"], data["memory"])


@dataclasses.dataclass(frozen=True)
class Slice:
    """A user's share of one GPU, or of several GPUs of one host.

    Attributes:
        gpu_uuid: NVML UUID of the GPU (``GPU-…``) or MIG instance (``MIG-…``);
            simulated devices use ``GPU-sim-…`` and ``MIG-sim-…``.
        gpu_index: NVML index of the GPU on the host (0-based; a MIG instance's parent
            GPU). Inside the user's server ``CUDA_VISIBLE_DEVICES`` names only this
            device, so frameworks see it as device 0.
        gpu_name: Product name as NVML reports it (``"NVIDIA H100 80GB HBM3"``).
        gpu_memory: Total memory of the GPU (of the MIG instance), bytes.
        memory_limit: The budget: bytes of GPU memory this server's kernels may hold,
            each. ``0 < memory_limit``; may exceed what is free on the card when the
            Hub overcommits.
        compute_share: Percent of the GPU's streaming multiprocessors, 1-100. Only the
            ``mig`` backend enforces it; ``mps`` applies it to the processes that keep
            the server's environment (:func:`compute_share_text`).
        placement: Policy the Hub used to pick the GPU, one of :data:`PLACEMENTS`.
        overcommit_ratio: Sum of budgets the Hub allows per GPU, as a multiple of
            ``gpu_memory`` (``>= 1.0``; exactly 1.0 for MIG instances).
        simulated: True when the GPU is simulated (no NVML device behind it).
        idle_seconds: A kernel that ran no code for this many seconds is idle: the node
            arbiter may pause it in the background while its card is above the
            arbiter's watermark, seconds (``> 0``).
        high_watermark: Fraction (0-1] of the budget; unused since the node arbiter
            decides when to pause (``ArbiterApp.watermark``, per card). Kept so that
            saved slices and existing configs stay valid.
        memory_request: Guaranteed bytes, ``0 < memory_request <= memory_limit``;
            None (the default) means the whole limit. Requests placed on one GPU sum
            to at most its memory.
        priority: Higher wins when the card is short of memory, an integer from
            :data:`MIN_PRIORITY` to :data:`MAX_PRIORITY` (default
            :data:`DEFAULT_PRIORITY`).
        isolation: How the GPU is shared, one of :data:`ISOLATIONS`.
        more_gpus: The slice's other cards, in the order the kernel sees them after
            the first (``CUDA_VISIBLE_DEVICES`` lists every card's UUID, so frameworks
            see them as devices 1, 2, ...); empty for a one-card slice. The budget,
            request and compute share hold on each card. Never under ``mig``; at most
            :data:`MAX_GPUS` cards in all, each UUID once.

    Raises:
        SliceError: a field is out of range (on construction).
    """

    gpu_uuid: str
    gpu_index: int
    gpu_name: str
    gpu_memory: int
    memory_limit: int
    compute_share: int
    placement: str = "binpack"
    overcommit_ratio: float = 1.0
    simulated: bool = False
    idle_seconds: float = 300.0
    high_watermark: float = 0.9
    memory_request: int | None = None
    priority: int = DEFAULT_PRIORITY
    isolation: str = "time-slicing"
    more_gpus: tuple[Card, ...] = ()

    def __post_init__(self) -> None:
        if self.memory_request is None and _is_int(self.memory_limit):
            object.__setattr__(self, "memory_request", self.memory_limit)
        _check(isinstance(self.more_gpus, (tuple, list)), "more_gpus must be a list of cards")
        object.__setattr__(
            self, "more_gpus", tuple(c if isinstance(c, Card) else Card.from_dict(c) for c in self.more_gpus)
        )
        _check(
            isinstance(self.gpu_uuid, str) and 0 < len(self.gpu_uuid) <= 128,
            "gpu_uuid must be a non-empty string of at most 128 characters",
        )
        _check(_is_int(self.gpu_index) and 0 <= self.gpu_index <= 4096, "gpu_index must be an integer 0-4096")
        _check(
            isinstance(self.gpu_name, str) and len(self.gpu_name) <= 256,
            "gpu_name must be a string of at most 256 characters",
        )
        for name in ("gpu_memory", "memory_limit", "memory_request"):
            value = getattr(self, name)
            _check(_is_int(value) and 0 < value <= MAX_BYTES, f"{name} must be a positive number of bytes")
        _check(
            self.memory_request <= self.memory_limit,
            f"memory_request ({self.memory_request} bytes) must not exceed memory_limit "
            f"({self.memory_limit} bytes)",
        )
        _check(
            _is_int(self.compute_share) and 1 <= self.compute_share <= 100,
            "compute_share must be an integer percentage between 1 and 100",
        )
        _check(
            _is_int(self.priority) and MIN_PRIORITY <= self.priority <= MAX_PRIORITY,
            f"priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}",
        )
        _check(self.isolation in ISOLATIONS, f"isolation must be one of {', '.join(ISOLATIONS)}")
        _check(self.placement in PLACEMENTS, f"placement must be one of {', '.join(PLACEMENTS)}")
        _check(
            _is_number(self.overcommit_ratio) and 1.0 <= self.overcommit_ratio <= 1000,
            "overcommit_ratio must be >= 1.0 (and at most 1000)",
        )
        _check(
            self.isolation != "mig" or self.overcommit_ratio == 1.0,
            "overcommit_ratio must be 1.0 for a MIG instance (no overcommit)",
        )
        _check(isinstance(self.simulated, bool), "simulated must be true or false")
        _check(
            _is_number(self.idle_seconds) and 0 < self.idle_seconds <= 31536000,
            "idle_seconds must be > 0 (and at most a year)",
        )
        _check(
            _is_number(self.high_watermark) and 0 < self.high_watermark <= 1,
            "high_watermark must be in (0, 1]",
        )
        _check(len(self.more_gpus) < MAX_GPUS, f"a slice spans at most {MAX_GPUS} cards")
        _check(
            len(set(self.gpu_uuids)) == len(self.gpu_uuids)
            and len(set(self.gpu_indices)) == len(self.gpu_indices),
            "more_gpus must name each card once, and not the slice's first card",
        )
        _check(
            not self.more_gpus or self.isolation != "mig",
            "more_gpus must be empty for a MIG instance (one instance per slice)",
        )
        _check(
            not self.more_gpus or self.memory_request <= min(c.memory for c in self.more_gpus),
            "memory_request must fit on each card of the slice",
        )

    @property
    def gpu_uuids(self) -> tuple[str, ...]:
        """Every card's UUID, the first card first (the order ``CUDA_VISIBLE_DEVICES``
        gives them)."""
        return (self.gpu_uuid, *(c.uuid for c in self.more_gpus))

    @property
    def gpu_indices(self) -> tuple[int, ...]:
        """Every card's NVML index, in the order of :attr:`gpu_uuids`."""
        return (self.gpu_index, *(c.index for c in self.more_gpus))

    def card_memory(self, uuid: str) -> int:
        """Total memory of the slice's card ``uuid``, bytes.

        Raises:
            KeyError: ``uuid`` is not a card of this slice.
        """
        if uuid == self.gpu_uuid:
            return self.gpu_memory
        for c in self.more_gpus:
            if c.uuid == uuid:
                return c.memory
        raise KeyError(uuid)

    def memory_fractions(self) -> tuple[float, ...]:
        """The budget as a fraction of each card, in (0, 1], in the order of
        :attr:`gpu_uuids` (device 0, 1, ... inside the server): what
        ``torch.cuda.set_per_process_memory_fraction(fraction, device)`` takes."""
        return tuple(min(1.0, self.memory_limit / self.card_memory(u)) for u in self.gpu_uuids)

    @property
    def memory_fraction(self) -> float:
        """The budget as a fraction of the first card, in (0, 1], for
        ``torch.cuda.set_per_process_memory_fraction`` (each card's:
        :meth:`memory_fractions`)."""
        return min(1.0, self.memory_limit / self.gpu_memory)

    @property
    def compute_share_text(self) -> str:
        """The compute share as people should read it (see :func:`compute_share_text`)."""
        return compute_share_text(self.isolation, self.compute_share, mig_profile(self.gpu_name))

    def replace(self, **changes: Any) -> Slice:
        """A copy with ``changes`` applied (validated like a new slice).

        A slice whose request is its whole limit keeps it so when only the limit
        changes (``replace(memory_limit=...)``); name ``memory_request`` to set it.

        Raises:
            SliceError: a changed field is out of range.
        """
        if (
            "memory_limit" in changes
            and "memory_request" not in changes
            and self.memory_request == self.memory_limit
        ):
            changes["memory_request"] = None
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The serialised form as a JSON-ready dict (includes ``version``)."""
        data = dataclasses.asdict(self)
        data["more_gpus"] = [dataclasses.asdict(c) for c in self.more_gpus]
        data["version"] = SCHEMA_VERSION
        return data

    def to_json(self) -> str:
        """The one serialised form: compact JSON with sorted keys."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def on_card(cls, gpu, memory_limit: int, compute_share: int, **fields: Any) -> Slice:
        """A slice of one real card as NVML lists it: ``gpu`` has ``uuid``, ``index``,
        ``name`` and ``memory_total`` (bytes), as :class:`jupyter_vgpu.nvml.GPUInfo` does;
        ``memory_limit`` in bytes, ``compute_share`` in percent, ``fields`` the others
        (``overcommit_ratio``, ``isolation``, ``more_gpus``...).

        Raises:
            SliceError: as the constructor does.
        """
        return cls(gpu.uuid, gpu.index, gpu.name, gpu.memory_total, memory_limit, compute_share, **fields)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Slice:
        """Parse the dict form written by :meth:`to_dict` (version 3), or an older one.

        Every field of the version is required and unknown fields are refused, so that
        a typo never silently drops a limit. A version-2 document has no ``more_gpus``
        (one card). A version-1 document may leave out the fields that had defaults then;
        it is read with ``memory_request`` equal to ``memory_limit``,
        :data:`DEFAULT_PRIORITY` and ``"time-slicing"``.

        Raises:
            SliceError: not a mapping, no or an unknown version, a field missing,
                unknown or out of range.
        """
        if not isinstance(data, Mapping):
            raise SliceError(f"a slice must be a JSON object, not {type(data).__name__}")
        data = dict(data)
        version = data.pop("version", None)
        if _is_int(version) and version == 1:
            names, required = _V1_FIELDS, _V1_FIELDS[:6]
        elif _is_int(version) and version in (2, SCHEMA_VERSION):
            names = required = tuple(
                f.name for f in dataclasses.fields(cls) if version == 3 or f.name != "more_gpus"
            )
        else:
            raise SliceError(f"slice version {version!r} is not supported (expected 1 to {SCHEMA_VERSION})")
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise SliceError(f"unknown slice field(s) for version {version}: {', '.join(unknown)}")
        missing = [n for n in required if n not in data]
        if missing:
            raise SliceError(f"missing slice field(s): {', '.join(missing)}")
        if version != 1 and data["memory_request"] is None:
            raise SliceError("memory_request must be a positive number of bytes")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str | bytes) -> Slice:
        """Parse the serialised form written by :meth:`to_json`.

        Raises:
            SliceError: the text is not JSON or does not describe a valid slice.
        """
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as e:
            raise SliceError(f"slice is not valid JSON: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Slice | None:
        """The slice in ``environ[SLICE_ENV]`` (default ``os.environ``), or None when unset.

        Raises:
            SliceError: the variable is set but malformed.
        """
        environ = os.environ if environ is None else environ
        text = environ.get(SLICE_ENV)
        if not text:
            return None
        return cls.from_json(text)

    def environment(self) -> dict[str, str]:
        """Environment variables that carry this slice into the user's server.

        ``JUPYTER_VGPU_SLICE`` (this slice), ``CUDA_VISIBLE_DEVICES`` (the UUID of the
        GPU or MIG instance, or of every card of the slice, comma-separated, first card
        first; real devices only), and the limits other frameworks read at start-up:
        JAX's ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (fraction of the smallest card, two
        decimals, rounded down; JAX applies it to each device) and CuPy's
        ``CUPY_GPU_MEMORY_LIMIT`` (bytes, per device). Under the ``mps`` backend also
        MPS's client limits: ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (the compute share)
        and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (``0=<MiB>M,1=<MiB>M,...``, the budget
        rounded down to MiB, for each visible device); they take effect only for
        clients of an MPS control daemon, which the node arbiter runs. Sources: JAX
        "GPU memory allocation", CuPy "Environment variables", NVIDIA MPS documentation
        (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` takes a list of ``device=limit``).
        """
        fraction = min(self.memory_fractions())
        env = {
            SLICE_ENV: self.to_json(),
            "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{math.floor(fraction * 100) / 100:.2f}",
            "CUPY_GPU_MEMORY_LIMIT": str(self.memory_limit),
        }
        if not self.simulated:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpu_uuids)
        if self.isolation == "mps":
            mib = max(1, self.memory_limit // 2**20)
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(self.compute_share)
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(
                f"{i}={mib}M" for i in range(len(self.gpu_uuids))
            )
        return env


def mig_profile(gpu_name: str) -> str | None:
    """The MIG profile in a device name (``"NVIDIA H100 80GB HBM3 MIG 3g.40gb"`` ->
    ``"3g.40gb"``), or None when the name is not a MIG instance's."""
    head, sep, tail = gpu_name.rpartition(" MIG ")
    return tail.strip() or None if sep and head else None


def _check(ok: object, message: str) -> None:
    if not ok:
        raise SliceError(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
