"""Hub-wide vGPU settings, and the one allocator every spawner and API handler shares."""

from __future__ import annotations

from jupyterhub.traitlets import ByteSpecification
from traitlets import Enum, Float, Instance, Integer, default, validate
from traitlets.config import SingletonConfigurable

from jupyter_vgpu.slice import PLACEMENTS

from .inventory import GPUInventory
from .placement import Allocator
from .quotas import Quota
from .usage import UsageBoard, gpu_rows, slice_rows


class VGPUHub(SingletonConfigurable):
    """Placement policy, overcommit, default quota and kernel policy for the whole Hub.

    Configure as ``c.VGPUHub.<trait>`` in ``jupyterhub_config.py``. One instance per Hub
    process (``VGPUHub.instance(config=...)``), shared by spawners and API handlers.
    """

    placement = Enum(
        list(PLACEMENTS),
        default_value="binpack",
        help="""How a new slice picks its GPU: 'binpack' (the fullest GPU that fits, keeping
        whole cards free) or 'spread' (the emptiest GPU, so users contend less).""",
    ).tag(config=True)

    overcommit_ratio = Float(
        1.0,
        help="""Budgets on one GPU may sum to this multiple of its memory (>= 1.0).
        Above 1.0 the Hub relies on kernels offloading idle tensors to host memory.""",
    ).tag(config=True)

    default_memory_limit = ByteSpecification(
        8 * 2**30,
        help="Budget of a user with no user or group quota, bytes or a size like '8G'.",
    ).tag(config=True)

    default_compute_share = Integer(
        100, help="Compute share of a user with no user or group quota, percent (1-100)."
    ).tag(config=True)

    idle_seconds = Float(
        300.0,
        help="A tensor no cell has referenced for this many seconds is idle and may be offloaded.",
    ).tag(config=True)

    high_watermark = Float(
        0.9,
        help="Kernels offload idle tensors when they hold more than this fraction (0-1] of their budget.",
    ).tag(config=True)

    inventory = Instance(GPUInventory, help="The GPUs slices are placed on.")

    @default("inventory")
    def _inventory_default(self):
        return GPUInventory(parent=self)

    @validate("overcommit_ratio")
    def _check_ratio(self, proposal):
        if not proposal.value >= 1.0:
            raise ValueError(f"VGPUHub.overcommit_ratio must be >= 1.0, not {proposal.value}")
        return proposal.value

    @validate("default_compute_share")
    def _check_share(self, proposal):
        if not 1 <= proposal.value <= 100:
            raise ValueError(f"VGPUHub.default_compute_share must be 1-100, not {proposal.value}")
        return proposal.value

    @validate("high_watermark")
    def _check_watermark(self, proposal):
        if not 0 < proposal.value <= 1:
            raise ValueError(f"VGPUHub.high_watermark must be in (0, 1], not {proposal.value}")
        return proposal.value

    _allocator: Allocator | None = None
    _usage: UsageBoard | None = None

    @property
    def usage(self) -> UsageBoard:
        """The servers' latest usage reports."""
        if self._usage is None:
            self._usage = UsageBoard()
        return self._usage

    def running(self, users, names=None) -> list[tuple]:
        """``(user, spawner)`` for every server holding a slice (of ``names`` only, if given).

        Args:
            users: the Hub's user cache (``app.users`` / ``handler.users``).
        """
        return [
            (user, spawner)
            for user in list(users.values())
            if names is None or user.name in names
            for spawner in user.spawners.values()
            if getattr(spawner, "vgpu_slice", None) is not None
        ]

    def snapshot(self, users, names=None) -> tuple[list[dict], list[dict]]:
        """``(slice rows, GPU rows)``: every running slice with its latest usage, and
        every GPU with the slices on it (see :mod:`hub_spawner.usage`)."""
        rows = slice_rows(((u.name, s) for u, s in self.running(users, names)), self.usage)
        return rows, gpu_rows(self.inventory.gpus, self.overcommit_ratio, rows)

    @property
    def allocator(self) -> Allocator:
        """The allocator over :attr:`inventory`'s GPUs (created on first use)."""
        if self._allocator is None:
            self._allocator = Allocator(self.inventory.gpus, self.overcommit_ratio)
        return self._allocator

    @property
    def default_quota(self) -> Quota:
        """The quota of a user with no user or group quota."""
        return Quota(int(self.default_memory_limit), self.default_compute_share)
