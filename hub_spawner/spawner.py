"""The spawner: every user's server gets a vGPU slice at start.

:class:`VGPUSpawnerMixin` adds slices to any JupyterHub spawner; put it first in the
bases, e.g. ``class MySpawner(VGPUSpawnerMixin, DockerSpawner)``. :class:`VGPUSpawner`
is the mixin on JupyterHub's ``LocalProcessSpawner``, registered as ``vgpu``:
``c.JupyterHub.spawner_class = "vgpu"``.

At start the mixin resolves the user's quota, asks the shared allocator for a GPU, and
passes the slice to the server in its environment (``Slice.environment()``). The slice
is saved in the spawner's state, so the Hub's database keeps it across restarts and
``load_state`` puts it back on its GPU.
"""

from __future__ import annotations

from typing import Any

from jupyterhub.spawner import LocalProcessSpawner, SimpleLocalProcessSpawner
from traitlets import HasTraits, default

from jupyter_vgpu.slice import Slice, SliceError

from .config import VGPUHub
from .placement import Placement
from .quotas import QuotaStore
from .sizes import format_size

STATE_KEY = "vgpu_slice"


class VGPUSpawnerMixin(HasTraits):
    """Gives each server a vGPU slice. Settings live on :class:`hub_spawner.config.VGPUHub`."""

    #: The running server's slice, or None while it is stopped.
    vgpu_slice: Slice | None = None

    @default("server_token_scopes")
    def _vgpu_server_token_scopes(self):
        # The server role's scopes, plus reading its own user, which the server
        # extension needs to poll GET /hub/api/vgpu/slices/users/{name}.
        return ["users:activity!user", "access:servers!server", "read:users!user"]

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

    def vgpu_place(self) -> Slice:
        """Place this server's slice and remember it.

        Raises:
            hub_spawner.placement.PlacementError: no GPU has room; its message is shown
                on the spawn page.
        """
        hub = self.vgpu_hub
        quota = self.vgpu_resolve()
        gpu = hub.allocator.place(self.vgpu_key, quota.memory_limit, quota.compute_share, hub.placement)
        self.vgpu_slice = Slice(
            gpu_uuid=gpu.uuid,
            gpu_index=gpu.index,
            gpu_name=gpu.name,
            gpu_memory=gpu.memory,
            memory_limit=quota.memory_limit,
            compute_share=quota.compute_share,
            placement=hub.placement,
            overcommit_ratio=hub.overcommit_ratio,
            simulated=gpu.simulated,
            idle_seconds=hub.idle_seconds,
            high_watermark=hub.high_watermark,
        )
        self.log.info(
            "vGPU slice for %s: GPU %d (%s), %s, %d%% compute",
            self._log_name,
            gpu.index,
            gpu.name,
            format_size(quota.memory_limit),
            quota.compute_share,
        )
        return self.vgpu_slice

    def vgpu_release(self) -> None:
        self.vgpu_hub.allocator.release(self.vgpu_key)
        self.vgpu_slice = None

    def vgpu_update(self, memory_limit: int, compute_share: int) -> Slice:
        """Apply a quota change to the running slice (same GPU) and save the state.

        Raises:
            hub_spawner.placement.PlacementError: the new budget does not fit on its GPU.
        """
        self.vgpu_hub.allocator.resize(self.vgpu_key, memory_limit, compute_share)
        self.vgpu_slice = self.vgpu_slice.replace(memory_limit=memory_limit, compute_share=compute_share)
        self.orm_spawner.state = self.get_state()
        self.user.db.commit()
        return self.vgpu_slice

    async def start(self):
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

    def get_env(self) -> dict[str, str]:
        env = super().get_env()
        if self.vgpu_slice is not None:
            env.update(self.vgpu_slice.environment())
        return env

    async def progress(self):
        if self.vgpu_slice is not None:
            s = self.vgpu_slice
            kind = "simulated " if s.simulated else ""
            yield {
                "progress": 40,
                "message": (
                    f"Placed your vGPU slice on {kind}GPU {s.gpu_index} ({s.gpu_name}): "
                    f"{format_size(s.memory_limit)} budget, {s.compute_share}% compute share"
                ),
            }
        async for event in super().progress():
            yield event

    def get_state(self) -> dict[str, Any]:
        state = super().get_state()
        if self.vgpu_slice is not None:
            state[STATE_KEY] = self.vgpu_slice.to_dict()
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        data = state.get(STATE_KEY)
        if not data:
            return
        try:
            self.vgpu_slice = Slice.from_dict(data)
            self.vgpu_hub.allocator.restore(
                Placement(
                    self.vgpu_key,
                    self.vgpu_slice.gpu_uuid,
                    self.vgpu_slice.memory_limit,
                    self.vgpu_slice.compute_share,
                )
            )
        except (SliceError, KeyError) as e:
            self.log.error("Dropping unusable saved vGPU slice of %s: %s", self._log_name, e)
            self.vgpu_slice = None

    def clear_state(self) -> None:
        super().clear_state()
        self.vgpu_release()


class VGPUSpawner(VGPUSpawnerMixin, LocalProcessSpawner):
    """``LocalProcessSpawner`` with a vGPU slice per server (entry point ``vgpu``)."""


class VGPUSimpleSpawner(VGPUSpawnerMixin, SimpleLocalProcessSpawner):
    """``SimpleLocalProcessSpawner`` with a vGPU slice per server (entry point ``vgpu-simple``).

    Runs every server as the Hub's own user: for demos and tests only, like its base.
    """
