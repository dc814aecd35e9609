"""The spawner: every user's server gets a vGPU slice at start.

:class:`VGPUSpawnerMixin` adds slices to any JupyterHub spawner; put it first in the
bases, e.g. ``class MySpawner(VGPUSpawnerMixin, DockerSpawner)``. :class:`VGPUSpawner`
is the mixin on JupyterHub's ``LocalProcessSpawner``, registered as ``vgpu``:
``c.JupyterHub.spawner_class = "vgpu"``.

At start the mixin resolves the user's quota, asks the shared allocator for a device
(a shared GPU, or the MIG instance the user picked on the spawn form), and passes the
slice to the server in its environment (``Slice.environment()``). The slice is saved
in the spawner's state, so the Hub's database keeps it across restarts and
``load_state`` puts it back on its device.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from jupyterhub.spawner import LocalProcessSpawner, SimpleLocalProcessSpawner
from traitlets import HasTraits, Integer, TraitError, Tuple, default, validate

from jupyter_vgpu.host.socket_path import SOCKET_ENV, mps_pipe_directory
from jupyter_vgpu.slice import Card, Slice, SliceError, mig_profile

from . import adoption, options, ports
from .config import VGPUHub
from .inventory import GPU
from .placement import Placement, PlacementError
from .profiles import Size
from .quotas import QuotaStore
from .server_cgroup import ServerCgroupMixin
from .sizes import format_size

#: The spawner state's keys: the running server's slice, and where it runs (a platform's).
STATE_KEY, WHERE_KEY = "vgpu_slice", "vgpu_where"


class VGPUSpawnerMixin(HasTraits):
    """Gives each server a vGPU slice. Settings live on :class:`hub_spawner.config.VGPUHub`."""

    #: The running server's slice, or None while it is stopped.
    vgpu_slice: Slice | None = None
    #: Where the running server is, as its platform knows it (a pod, a Slurm job), saved
    #: with the slice; ``{}`` on one host and while it is stopped.
    vgpu_where: dict[str, Any] = {}
    #: Whether servers of different users run as one Unix account (the Hub page warns).
    vgpu_shared_account = False
    #: The kind of spawner, written into the state of every running server: a Hub whose
    #: spawner is of another kind ends such a server instead of losing track of it
    #: (:mod:`hub_spawner.adoption`).
    vgpu_kind = "local"
    #: A running server of another kind of spawner, loaded from the database, to end.
    _vgpu_foreign: dict[str, Any] | None = None

    @default("server_token_scopes")
    def _vgpu_server_token_scopes(self):
        # The server role's scopes, plus reading its own user, which the server
        # extension needs to poll GET /hub/api/vgpu/slices/users/{name}.
        return ["users:activity!user", "access:servers!server", "read:users!user"]

    @default("options_form")
    def _vgpu_options_form(self):
        return VGPUSpawnerMixin.vgpu_options_form

    @property
    def vgpu_hub(self) -> VGPUHub:
        return VGPUHub.instance(config=self.config)

    @property
    def vgpu_key(self) -> str:
        return f"{self.user.name}/{self.name}"

    def vgpu_resolve(self):
        """The user's effective quota (:class:`hub_spawner.quotas.Effective`)."""
        groups = [g.name for g in self.user.groups]
        return QuotaStore(self.user.db).resolve(self.user.name, groups, self.vgpu_hub.default_quota)

    def vgpu_options_form(self) -> str:
        """The spawn form: on hubs with MIG instances, a shared slice or a MIG profile
        that fits the user's quota; "" (no form) elsewhere."""
        allocator = self.vgpu_hub.allocator
        effective = self.vgpu_resolve()
        return options.render_form(
            shared=bool(allocator.shared),
            isolation=self.vgpu_hub.isolation,
            effective=effective,
            profiles=allocator.profiles(effective.memory_limit, excluding=self.vgpu_key),
        )

    def options_from_form(self, formdata):
        return options.options_from_form(formdata)

    def vgpu_place(self) -> Slice:
        """Place this server's slice and remember it.

        Raises:
            hub_spawner.placement.PlacementError: no device has room, the MIG profile
                asked for is unknown, taken or above the quota; its message is shown on
                the spawn page.
        """
        hub = self.vgpu_hub
        allocator = hub.allocator
        # a card that stopped answering NVML takes no new slice (allocator.down, as the Hub
        # last looked: VGPUHub.devices_checked, which the spawner's start awaits first)
        quota = self.vgpu_resolve()
        try:
            profile = options.requested_profile(self.user_options)
        except ValueError as e:
            raise PlacementError(str(e)) from None
        if profile is not None or (allocator.gpus and not allocator.shared):
            gpu = allocator.place_instance(self.vgpu_key, profile, quota.memory_limit)
            whole = Size(gpu.memory, gpu.memory, gpu.compute_percent or 100, quota.priority)
            self.vgpu_slice = self.vgpu_new_slice(gpu, whole, "mig")
        else:
            cards = allocator.place_cards(
                self.vgpu_key,
                quota.memory_limit,
                quota.compute_share,
                hub.placement,
                quota.memory_request,
                count=quota.gpu_count,
            )
            if len(cards) > 1 and any(g.isolation == "mps" for g in cards):
                allocator.release(self.vgpu_key)
                raise PlacementError(
                    f"Your quota asks for {len(cards)} GPUs per slice, and this hub shares its GPUs "
                    "through MPS, whose clients each reach one card's daemon: ask an admin for a "
                    "gpu_count of 1."
                )
            self.vgpu_slice = self.vgpu_new_slice(cards[0], quota, cards[0].isolation, more=cards[1:])
        self.log.info("vGPU slice for %s: %s", self._log_name, self.vgpu_describe())
        return self.vgpu_slice

    def vgpu_new_slice(self, device: GPU, sizes, isolation: str, more: Sequence[GPU] = ()) -> Slice:
        """A slice of ``device`` (and of the cards ``more``) with ``sizes``, and the Hub's
        settings every slice carries (placement policy, overcommit ratio, idle seconds,
        high watermark). The one place a spawner makes a slice.

        Args:
            device: the GPU or MIG instance (:class:`hub_spawner.inventory.GPU`): its
                UUID, index, name, memory in bytes and whether it is simulated.
            sizes: ``memory_limit`` and ``memory_request`` in bytes, ``compute_share`` in
                percent, ``priority`` (a :class:`hub_spawner.profiles.Size`, or the
                user's :class:`hub_spawner.quotas.Effective` quota).
            isolation: the slice's isolation backend; a ``mig`` slice is never
                overcommitted (ratio 1.0).
            more: the slice's other cards, for a slice of several (the budget, request
                and compute share hold on each).

        Raises:
            jupyter_vgpu.slice.SliceError: a field is out of range.
        """
        hub = self.vgpu_hub
        return Slice(
            gpu_uuid=device.uuid,
            gpu_index=device.index,
            gpu_name=device.name,
            gpu_memory=device.memory,
            memory_limit=sizes.memory_limit,
            memory_request=sizes.memory_request,
            compute_share=sizes.compute_share,
            priority=sizes.priority,
            isolation=isolation,
            placement=hub.placement,
            overcommit_ratio=1.0 if isolation == "mig" else hub.overcommit_ratio,
            simulated=device.simulated,
            idle_seconds=hub.idle_seconds,
            high_watermark=hub.high_watermark,
            more_gpus=tuple(Card(g.uuid, g.index, g.memory) for g in more),
        )

    def vgpu_describe(self) -> str:
        """The running slice in one sentence, as the spawn page shows it."""
        s = self.vgpu_slice
        kind = "simulated " if s.simulated else ""
        if s.isolation == "mig":
            return (
                f"MIG instance {mig_profile(s.gpu_name)} of {kind}GPU {s.gpu_index} "
                f"({s.gpu_name}): {format_size(s.memory_limit)}, guaranteed, a hardware partition "
                f"with {s.compute_share}% of the GPU's SMs; priority {s.priority}"
            )
        guaranteed = (
            "all of it guaranteed"
            if s.memory_request == s.memory_limit
            else f"{format_size(s.memory_request)} guaranteed"
        )
        if s.more_gpus:
            indices = [str(i) for i in s.gpu_indices]
            return (
                f"{kind}GPUs {', '.join(indices[:-1])} and {indices[-1]} ({s.gpu_name}): "
                f"{format_size(s.memory_limit)} budget on each, {guaranteed}; "
                f"compute share {s.compute_share_text}; priority {s.priority}"
            )
        return (
            f"{kind}GPU {s.gpu_index} ({s.gpu_name}): {format_size(s.memory_limit)} budget, {guaranteed}; "
            f"compute share {s.compute_share_text}; priority {s.priority}"
        )

    def vgpu_release(self) -> None:
        """Give the slice's room back and forget the server's last usage report and
        where it ran."""
        self.vgpu_hub.allocator.release(self.vgpu_key)
        self.vgpu_hub.usage.forget(self.vgpu_key)
        self.vgpu_slice = None
        self.vgpu_where = {}

    def vgpu_check_update(self, effective) -> None:
        """Check that the running slice may take ``effective``'s sizes on its device.

        Raises:
            hub_spawner.placement.PlacementError: they do not fit next to the others.
        """
        self.vgpu_hub.allocator.check_resize(self.vgpu_key, effective.memory_limit, effective.memory_request)

    def vgpu_listing(self) -> dict[str, Any]:
        """Fields the slice listings add about where the server runs ({} on one host)."""
        return {}

    def vgpu_account(self) -> tuple[int | None, str] | None:
        """``(uid, name)`` of the Unix account the running server runs as (its process's
        owner, on this host), or None where the Hub cannot tell."""
        from .isolation import process_account

        return process_account(getattr(self, "pid", None))

    def vgpu_update(self, effective) -> Slice:
        """Apply a quota change to the running slice (same device) and save the state.

        A MIG instance keeps its size and share; only its priority follows the quota.

        Args:
            effective: the user's new effective quota (:class:`hub_spawner.quotas.Effective`).

        Raises:
            hub_spawner.placement.PlacementError: the new sizes do not fit on its GPU.
        """
        s = self.vgpu_slice
        if s.isolation == "mig":
            self.vgpu_slice = s.replace(priority=effective.priority)
        else:
            self.vgpu_hub.allocator.resize(
                self.vgpu_key, effective.memory_limit, effective.compute_share, effective.memory_request
            )
            self.vgpu_slice = s.replace(
                memory_limit=effective.memory_limit,
                memory_request=effective.memory_request,
                compute_share=effective.compute_share,
                priority=effective.priority,
            )
        self.orm_spawner.state = self.get_state()
        self.user.db.commit()
        return self.vgpu_slice

    async def start(self):
        self._vgpu_foreign = None  # a new server: what the database said before is gone
        await self.vgpu_hub.devices_checked()
        self.vgpu_place()
        try:
            return await super().start()
        except BaseException:
            self.vgpu_release()
            raise

    async def stop(self, now=False):
        try:
            return await super().stop(now=now)
        finally:
            self.vgpu_release()

    def get_args(self) -> list[str]:
        """The server's arguments, with ``--KernelManager.transport=ipc`` where
        ``VGPUHub.kernel_transport`` is "ipc" and the arguments name no kernel manager's
        transport (``--KernelManager.transport``, ``--ServerKernelManager.transport``)."""
        args = list(super().get_args())  # a copy: JupyterHub's is the Spawner.args trait itself
        named = any(a.startswith("--") and "KernelManager.transport" in a for a in args)
        if self.vgpu_hub.kernel_transport == "ipc" and not named:
            args.append("--KernelManager.transport=ipc")
        return args

    def get_env(self) -> dict[str, str]:
        env = super().get_env()
        if self.vgpu_slice is not None:
            env.update(self.vgpu_slice.environment())
            socket = self.vgpu_hub.arbiter_socket
            if socket:
                env[SOCKET_ENV] = socket
                if self.vgpu_slice.isolation == "mps":
                    # the arbiter's MPS daemon for this GPU (jupyter_vgpu.node.mps)
                    env["CUDA_MPS_PIPE_DIRECTORY"] = mps_pipe_directory(socket, self.vgpu_slice.gpu_uuid)
        return env

    async def progress(self):
        if self.vgpu_slice is not None:
            yield {"progress": 40, "message": f"Placed your vGPU slice on {self.vgpu_describe()}"}
        async for event in super().progress():
            yield event

    def get_state(self) -> dict[str, Any]:
        state = super().get_state()
        if self.vgpu_slice is not None:  # while the server runs
            state[STATE_KEY] = self.vgpu_slice.to_dict()
            state[adoption.KIND_KEY] = self.vgpu_kind
            if self.vgpu_where:
                state[WHERE_KEY] = dict(self.vgpu_where)
        return state

    def vgpu_foreign(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` holds a running server of another kind of spawner (kept to be
        ended by :meth:`poll`; nothing of it is loaded)."""
        kind = adoption.kind_of(state)
        self._vgpu_foreign = dict(state) if kind is not None and kind != self.vgpu_kind else None
        return self._vgpu_foreign is not None

    async def poll(self):
        """A running server of another kind of spawner, loaded from the database, is
        ended here (this spawner cannot adopt it) and reported stopped; anything else is
        the base spawner's to answer."""
        foreign, self._vgpu_foreign = self._vgpu_foreign, None
        if foreign is not None and self.server is not None:  # the database says it runs
            await asyncio.get_running_loop().run_in_executor(
                None,
                adoption.end,
                foreign,
                adoption.kind_of(foreign),
                self.user.name,
                self._log_name,
                self.vgpu_kind,
                self.log,
            )
            return 1
        return await super().poll()

    def load_state(self, state: dict[str, Any]) -> None:
        """The base spawner's state, and the running server's slice, where it ran
        (:attr:`vgpu_where`) and its place in the Hub's books (:meth:`vgpu_restore`); a
        running server of another kind of spawner is kept to be ended instead
        (:meth:`vgpu_foreign`), nothing of it loaded. An unusable saved slice is logged
        and dropped."""
        if self.vgpu_foreign(state):
            return
        super().load_state(state)
        data = state.get(STATE_KEY)
        if not data:
            return
        try:
            self.vgpu_slice = Slice.from_dict(data)
            self.vgpu_where = dict(state.get(WHERE_KEY) or {})
            self.vgpu_restore(state)
        except (SliceError, KeyError) as e:
            self.log.error("Dropping unusable saved vGPU slice of %s: %s", self._log_name, e)
            self.vgpu_slice = None

    def vgpu_restore(self, state: dict[str, Any]) -> None:
        """Put the slice just loaded from ``state`` back in the Hub's books: here its
        placement on its device, unchecked (it runs there whether it fits or not).

        Raises:
            KeyError: its device is not in the inventory (the slice is then dropped).
        """
        s = self.vgpu_slice
        self.vgpu_hub.allocator.restore(
            Placement(
                self.vgpu_key, s.gpu_uuid, s.memory_limit, s.compute_share, s.memory_request, s.gpu_uuids[1:]
            )
        )

    def clear_state(self) -> None:
        super().clear_state()
        self._vgpu_foreign = None
        self.vgpu_release()


class LocalPortsMixin(HasTraits):
    """Local servers' ports from ``port_range`` (:mod:`hub_spawner.ports`), not from the
    OS's ephemeral range, where a kernel's ZeroMQ socket could take a port between the
    Hub's choice and the server's bind."""

    port_range = Tuple(
        Integer(),
        Integer(),
        default_value=ports.SERVER_RANGE,
        help="Ports (first, last; inclusive) that servers started on this host get, unless "
        "Spawner.port is set. Keep it outside the OS's ephemeral range "
        "(/proc/sys/net/ipv4/ip_local_port_range), which kernels' sockets draw from.",
    ).tag(config=True)

    @validate("port_range")
    def _check_port_range(self, proposal):
        low, high = proposal["value"]
        try:
            ports.check_range(low, high)
        except ValueError as e:
            raise TraitError(f"port_range: {e}") from None
        ephemeral = ports.ephemeral_range()
        if ports.overlap((low, high), ephemeral):
            self.log.warning(
                "port_range %d-%d overlaps the OS's ephemeral range %d-%d: a kernel may take a "
                "server's port before the server binds it",
                low,
                high,
                *ephemeral,
            )
        return proposal["value"]

    async def start(self):
        if self.port == 0:
            self.port = ports.picker(*self.port_range).pick(self.ip or "")
        return await super().start()


class VGPUSpawner(ServerCgroupMixin, VGPUSpawnerMixin, LocalPortsMixin, LocalProcessSpawner):
    """``LocalProcessSpawner`` with a vGPU slice per server (entry point ``vgpu``), each
    server in a cgroup of its own (:mod:`hub_spawner.server_cgroup`), as its user's own
    system account: users cannot touch each other's processes."""


class VGPUSimpleSpawner(ServerCgroupMixin, VGPUSpawnerMixin, LocalPortsMixin, SimpleLocalProcessSpawner):
    """``SimpleLocalProcessSpawner`` with a vGPU slice per server (entry point ``vgpu-simple``),
    each server in a cgroup of its own.

    Runs every server as the Hub's own user: any user can signal, trace or read another's
    kernels. For demos and tests only, like its base.
    """

    #: Every server runs as one account (the Hub page warns the admin).
    vgpu_shared_account = True
