"""The vGPU slice: the one contract between the Hub, the user's server and its kernels.

A :class:`Slice` is a small frozen record: which GPU, how many bytes of its memory the
user may hold (the *budget*), which percentage of its compute (the *compute share*),
and the policy the kernel follows when the card is short of memory. The Hub creates
it at spawn time, serialises it once with :meth:`Slice.to_json`, and hands it to the
single-user server in the ``JUPYTER_VGPU_SLICE`` environment variable. The server
and the kernels parse it with :meth:`Slice.from_json` and nothing else: nothing
downstream re-derives a slice.

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

#: Version of the serialised form; bumped when a field changes meaning.
SCHEMA_VERSION = 1


class SliceError(ValueError):
    """A serialised slice is malformed or one of its fields is out of range."""


@dataclasses.dataclass(frozen=True)
class Slice:
    """A user's share of one GPU.

    Attributes:
        gpu_uuid: NVML UUID of the GPU (``GPU-…`` or ``MIG-…``); simulated GPUs use
            ``GPU-sim-…``.
        gpu_index: NVML index of the GPU on the host (0-based). Inside the user's
            server ``CUDA_VISIBLE_DEVICES`` names only this GPU, so frameworks see it
            as device 0.
        gpu_name: Product name as NVML reports it (``"NVIDIA H100 80GB HBM3"``).
        gpu_memory: Total memory of the GPU, bytes.
        memory_limit: The budget: bytes of GPU memory this server's kernels may hold,
            each. ``0 < memory_limit``; may exceed what is free on the card when the
            Hub overcommits.
        compute_share: Percent of the GPU's streaming multiprocessors, 1-100.
        placement: Policy the Hub used to pick the GPU, one of :data:`PLACEMENTS`.
        overcommit_ratio: Sum of budgets the Hub allows per GPU, as a multiple of
            ``gpu_memory`` (``>= 1.0``).
        simulated: True when the GPU is simulated (no NVML device behind it).
        idle_seconds: A tensor no cell has referenced for this many seconds is idle
            and may be offloaded, seconds (``> 0``).
        high_watermark: Fraction of the budget (0-1] above which the kernel offloads
            idle tensors.
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

    def __post_init__(self) -> None:
        _check(isinstance(self.gpu_uuid, str) and self.gpu_uuid, "gpu_uuid must be a non-empty string")
        _check(_is_int(self.gpu_index) and self.gpu_index >= 0, "gpu_index must be an integer >= 0")
        _check(isinstance(self.gpu_name, str), "gpu_name must be a string")
        _check(
            _is_int(self.gpu_memory) and self.gpu_memory > 0, "gpu_memory must be a positive number of bytes"
        )
        _check(
            _is_int(self.memory_limit) and self.memory_limit > 0,
            "memory_limit must be a positive number of bytes",
        )
        _check(
            _is_int(self.compute_share) and 1 <= self.compute_share <= 100,
            "compute_share must be an integer percentage between 1 and 100",
        )
        _check(self.placement in PLACEMENTS, f"placement must be one of {', '.join(PLACEMENTS)}")
        _check(
            _is_number(self.overcommit_ratio) and self.overcommit_ratio >= 1.0,
            "overcommit_ratio must be >= 1.0",
        )
        _check(isinstance(self.simulated, bool), "simulated must be true or false")
        _check(_is_number(self.idle_seconds) and self.idle_seconds > 0, "idle_seconds must be > 0")
        _check(
            _is_number(self.high_watermark) and 0 < self.high_watermark <= 1,
            "high_watermark must be in (0, 1]",
        )

    @property
    def memory_fraction(self) -> float:
        """The budget as a fraction of the card, in (0, 1], for
        ``torch.cuda.set_per_process_memory_fraction``."""
        return min(1.0, self.memory_limit / self.gpu_memory)

    def replace(self, **changes: Any) -> Slice:
        """A copy with ``changes`` applied (validated like a new slice).

        Raises:
            SliceError: a changed field is out of range.
        """
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The serialised form as a JSON-ready dict (includes ``version``)."""
        data = dataclasses.asdict(self)
        data["version"] = SCHEMA_VERSION
        return data

    def to_json(self) -> str:
        """The one serialised form: compact JSON with sorted keys."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Slice:
        """Parse the dict form written by :meth:`to_dict`.

        Unknown fields are refused so that a typo never silently drops a limit.

        Raises:
            SliceError: not a mapping, a field is missing, unknown or out of range, or
                the version is not :data:`SCHEMA_VERSION`.
        """
        if not isinstance(data, Mapping):
            raise SliceError(f"a slice must be a JSON object, not {type(data).__name__}")
        data = dict(data)
        version = data.pop("version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise SliceError(f"slice version {version!r} is not supported (expected {SCHEMA_VERSION})")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise SliceError(f"unknown slice field(s): {', '.join(unknown)}")
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise SliceError(f"missing slice field(s): {', '.join(missing)}")
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

        ``JUPYTER_VGPU_SLICE`` (this slice), ``CUDA_VISIBLE_DEVICES`` (the GPU's UUID,
        real GPUs only), and the limits other frameworks read at start-up: JAX's
        ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (fraction of the card, two decimals,
        rounded down) and CuPy's ``CUPY_GPU_MEMORY_LIMIT`` (bytes). Sources: JAX "GPU
        memory allocation" docs; CuPy "Environment variables" docs.
        """
        env = {
            SLICE_ENV: self.to_json(),
            "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{math.floor(self.memory_fraction * 100) / 100:.2f}",
            "CUPY_GPU_MEMORY_LIMIT": str(self.memory_limit),
        }
        if not self.simulated:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu_uuid
        return env


def _check(ok: object, message: str) -> None:
    if not ok:
        raise SliceError(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
