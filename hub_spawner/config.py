"""Hub-wide vGPU settings, and the one allocator every spawner and API handler shares.

``python -m hub_spawner.config`` prints JupyterHub's whole default configuration with
this package's sections (``VGPUHub``, ``GPUInventory``) added, as
``jupyterhub --generate-config`` would if it knew them: JupyterHub lists only its own
classes and those behind its spawner, authenticator and proxy entry points.
"""

from __future__ import annotations

import asyncio
import sys
import time

from jupyterhub.traitlets import ByteSpecification
from traitlets import Dict, Enum, Float, Instance, Integer, TraitError, Unicode, default, validate
from traitlets.config import SingletonConfigurable

from jupyter_vgpu.slice import DEFAULT_PRIORITY, ISOLATIONS, MAX_GPUS, MAX_PRIORITY, MIN_PRIORITY, PLACEMENTS

from .inventory import GPUInventory
from .nodes import NodeBoard
from .placement import Allocator
from .quotas import Quota
from .usage import UsageBoard, gpu_rows, slice_rows

#: Seconds between two looks at whether each card still answers NVML (:meth:`VGPUHub.check_devices`).
CHECK_EVERY = 2.0


class VGPUHub(SingletonConfigurable):
    """Placement policy, overcommit, isolation, default quota and kernel policy for the whole Hub.

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
        help="""Memory limits on one shared GPU may sum to this multiple of its memory
        (>= 1.0); memory requests always sum to at most its memory. Above 1.0 the Hub
        relies on idle kernels leaving the card. MIG instances are never overcommitted.""",
    ).tag(config=True)

    isolation = Enum(
        list(ISOLATIONS),
        default_value="time-slicing",
        help="""How GPUs are shared. 'time-slicing': the memory budget is watched, the
        compute share is not enforced (shown as "not enforced (time-sliced)").
        'mps': the kernels are clients of NVIDIA MPS (the node arbiter runs the daemons):
        cells that meet share the card without time-slicing's switches, and the compute
        share and budget are MPS's limits from the server's environment, which a user's
        process can clear; the daemon then holds it to the largest share and budget of
        the card's mps slices (the share is shown as not enforced; the budget is still
        watched by the node arbiter). 'mig': GPUs are partitioned by the admin into MIG
        instances and each slice gets one whole instance. A GPU in MIG mode is always
        'mig'. Override per GPU with `gpu_isolation`.""",
    ).tag(config=True)

    gpu_isolation = Dict(
        key_trait=Unicode(),
        value_trait=Enum(list(ISOLATIONS)),
        help="""Isolation per GPU, by NVML index ("0") or UUID, overriding `isolation`,
        e.g. {"1": "mps"}.""",
    ).tag(config=True)

    min_memory_limit = ByteSpecification(
        256 * 2**20,
        help="""The smallest memory limit or request a quota may set, bytes or a size like
        '256M'. Smaller budgets leave no room for a CUDA context and are refused with 400.""",
    ).tag(config=True)

    default_memory_limit = ByteSpecification(
        8 * 2**30,
        help="Memory limit (budget) of a user with no user or group quota, bytes or a size like '8G'.",
    ).tag(config=True)

    default_memory_request = ByteSpecification(
        None,
        allow_none=True,
        help="""Guaranteed memory of a user with no user or group quota, bytes or a size
        like '4G'; None (default): the whole memory limit.""",
    ).tag(config=True)

    default_compute_share = Integer(
        100, help="Compute share of a user with no user or group quota, percent (1-100)."
    ).tag(config=True)

    default_priority = Integer(
        DEFAULT_PRIORITY,
        help=f"""Priority of a user with no user or group quota, {MIN_PRIORITY}-{MAX_PRIORITY};
        higher wins when a card is short of memory.""",
    ).tag(config=True)

    default_gpu_count = Integer(
        1,
        help="""Cards per slice of a user with no user or group quota (from 1). A slice of
        several cards has the budget and request on each, all on one host; it is placed by
        VGPUSpawner (profile-sized spawners take their size from the profile, one card).
        Not offered where the GPUs are shared through MPS.""",
    ).tag(config=True)

    idle_seconds = Float(
        300.0,
        help="""A kernel that ran no code for this many seconds is idle: the node arbiter
        may pause it in the background while its card is above the arbiter's watermark.""",
    ).tag(config=True)

    high_watermark = Float(
        0.9,
        help="""Unused: the node arbiter decides when to pause (ArbiterApp.watermark, per
        card). Kept so that existing configs stay valid; must be in (0, 1].""",
    ).tag(config=True)

    arbiter_socket = Unicode(
        "",
        help="""The node arbiter's Unix socket, given to every server and kernel in
        JUPYTER_VGPU_ARBITER. Set by hub_spawner.setup(c), which also runs the arbiter on it
        as the managed service 'vgpu-arbiter'; empty: no arbiter (kernels keep their
        in-kernel budget; nobody makes room on a full card).""",
    ).tag(config=True)

    kernel_transport = Enum(
        ["ipc", "tcp"],
        default_value="ipc",
        help="""How a spawned server's kernels talk to it. "ipc" (the default): Unix sockets
        in a directory only the user can enter (--KernelManager.transport=ipc; the server
        extension keeps their paths short, jupyter_vgpu.server.kernel_sockets). "tcp":
        jupyter_client's default, ports on the loopback interface, where any account of
        the host can connect: messages are signed, not encrypted, so another user who
        subscribes to a kernel's IOPub port reads every output of its cells. A transport
        named in Spawner.args wins over this.""",
    ).tag(config=True)

    inventory = Instance(GPUInventory, help="The GPUs slices are placed on.")

    @default("inventory")
    def _inventory_default(self):
        return GPUInventory(parent=self)

    @validate("overcommit_ratio")
    def _check_ratio(self, proposal):
        if not 1.0 <= proposal.value <= 1000:
            raise ValueError(f"VGPUHub.overcommit_ratio must be from 1.0 to 1000, not {proposal.value}")
        return proposal.value

    @validate("default_compute_share")
    def _check_share(self, proposal):
        if not 1 <= proposal.value <= 100:
            raise ValueError(f"VGPUHub.default_compute_share must be 1-100, not {proposal.value}")
        return proposal.value

    @validate("default_priority")
    def _check_priority(self, proposal):
        if not MIN_PRIORITY <= proposal.value <= MAX_PRIORITY:
            raise ValueError(
                f"VGPUHub.default_priority must be {MIN_PRIORITY}-{MAX_PRIORITY}, not {proposal.value}"
            )
        return proposal.value

    @validate("default_gpu_count")
    def _check_gpu_count(self, proposal):
        if not 1 <= proposal.value <= MAX_GPUS:
            raise TraitError(f"VGPUHub.default_gpu_count must be 1-{MAX_GPUS}, not {proposal.value}")
        return proposal.value

    @validate("high_watermark")
    def _check_watermark(self, proposal):
        if not 0 < proposal.value <= 1:
            raise ValueError(f"VGPUHub.high_watermark must be in (0, 1], not {proposal.value}")
        return proposal.value

    @validate("min_memory_limit", "default_memory_limit", "default_memory_request")
    def _check_sizes(self, proposal):
        value = proposal.value
        if value is not None and value < 1:
            raise ValueError(f"VGPUHub.{proposal.trait.name} must be a positive size, not {value}")
        return value

    _allocator: Allocator | None = None
    _usage: UsageBoard | None = None
    _nodes: NodeBoard | None = None
    _problems: list[str] | None = None

    @property
    def nodes(self) -> NodeBoard:
        """The Kubernetes GPU nodes as their arbiters report them (empty on one host)."""
        if self._nodes is None:
            self._nodes = NodeBoard()
        return self._nodes

    def devices(self) -> list:
        """Every device slices may be on: this host's (the allocator's; on Slurm, the
        nodes') and every node's its arbiter reported (:attr:`nodes`), each once."""
        seen: dict[str, object] = {}
        for d in [*self.allocator.gpus, *self.nodes.devices()]:
            seen.setdefault(d.uuid, d)
        return list(seen.values())

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
        """``(slice rows, device rows)``: every running slice with its latest usage, and
        every device with the slices on it (see :mod:`hub_spawner.usage`)."""
        rows = slice_rows(((u.name, s) for u, s in self.running(users, names)), self.usage)
        return rows, gpu_rows(self.devices(), self.overcommit_ratio, rows)

    @property
    def problems(self) -> list[str]:
        """Why some GPU (or every GPU) takes no slice: NVML failures (at start, and of a
        card that stopped answering since, as last looked: :meth:`devices_checked`), MIG
        settings. Makes no NVML call."""
        allocator = self.allocator
        down = allocator.down
        now = [
            f"{g.label} ({g.name}) takes no new slice: {down[g.uuid]}; the slices on it stay as they are"
            for g in allocator.gpus
            if g.uuid in down
        ]
        return list(self._problems or []) + now

    _checked_at: float | None = None
    _checking: asyncio.Future | None = None

    def _look_due(self) -> bool:
        """Whether the last look at the cards is over :data:`CHECK_EVERY` seconds old (or
        none was made)."""
        return self._checked_at is None or time.monotonic() - self._checked_at >= CHECK_EVERY

    async def devices_checked(self) -> dict[str, str]:
        """:meth:`check_devices`, off the Hub's event loop (in its default executor): an
        NVML query of a card that fell off the bus may take seconds, and every request of
        every user would wait meanwhile. Callers at the same time share one look; within
        :data:`CHECK_EVERY` seconds of the last one, none is made. Returns
        ``{uuid: why}`` as :meth:`check_devices` does."""
        allocator = self.allocator  # made here, on the loop, before any thread looks
        if self._checking is None or self._checking.done():
            if not self._look_due():
                return allocator.down
            self._checking = asyncio.get_running_loop().run_in_executor(None, self.check_devices)
        return await asyncio.shield(self._checking)

    def check_devices(self) -> dict[str, str]:
        """The devices of this host that take no new slice now, ``{uuid: why}``: those whose
        card no longer answers NVML (:meth:`GPUInventory.down`), looked at again when
        the last look is over :data:`CHECK_EVERY` seconds old, and handed to the allocator,
        which places around them. A card that answers again takes slices again."""
        allocator = self.allocator
        if self._look_due():
            self._checked_at = time.monotonic()
            down = self.inventory.down(allocator.gpus)
            for uuid in down.keys() - allocator.down.keys():
                self.log.error("vGPU: %s takes no new slice: %s", uuid, down[uuid])
            for uuid in allocator.down.keys() - down.keys():
                self.log.info("vGPU: %s answers NVML again and takes slices again", uuid)
            allocator.down = down
        return allocator.down

    @property
    def allocator(self) -> Allocator:
        """The allocator over the inventory's devices (created on first use)."""
        if self._allocator is None:
            devices, problems = self.inventory.devices(self.isolation, self.gpu_isolation)
            for p in problems:
                self.log.error("vGPU: %s", p)
            self._problems = problems
            self._allocator = Allocator(devices, self.overcommit_ratio, "; ".join(problems) or None)
        return self._allocator

    @property
    def default_quota(self) -> Quota:
        """The quota of a user with no user or group quota (every field set but the request)."""
        return Quota(
            memory_limit=int(self.default_memory_limit),
            compute_share=self.default_compute_share,
            memory_request=None if self.default_memory_request is None else int(self.default_memory_request),
            priority=self.default_priority,
            gpu_count=self.default_gpu_count,
        )


def generate_config() -> str:
    """JupyterHub's default configuration file with ``VGPUHub`` and ``GPUInventory`` added."""
    from jupyterhub.app import JupyterHub

    app = JupyterHub()
    return app.generate_config_file(classes=[*app.classes, VGPUHub, GPUInventory])


if __name__ == "__main__":  # python -m hub_spawner.config > jupyterhub_config.py
    sys.stdout.write(generate_config())
