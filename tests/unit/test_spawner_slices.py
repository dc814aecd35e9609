"""The spawner mixin on one host: its shared and MIG slices made by the one slice factory
(the Hub's settings in every slice, a MIG instance never overcommitted), and the state
chain (the slice and its placement back after a Hub restart; another kind of spawner's
running server recognised and not loaded). Real spawners of real Hub users, simulated
GPUs; no server is started."""

from __future__ import annotations

import pytest
from jupyterhub import orm
from jupyterhub.objects import Hub
from jupyterhub.spawner import LocalProcessSpawner
from jupyterhub.user import User
from traitlets.config import Config

from hub_spawner import adoption
from hub_spawner.config import VGPUHub
from hub_spawner.quotas import Quota, QuotaStore
from hub_spawner.spawner import VGPUSpawnerMixin

GiB = 2**30


class Local(VGPUSpawnerMixin, LocalProcessSpawner):
    """The mixin on JupyterHub's local spawner, without per-server cgroups."""


@pytest.fixture
def hub(tmp_path):
    """A Hub database (ada: 16 GiB, 4 GiB guaranteed, 30%, priority 70) and a Hub of two
    simulated 80 GiB GPUs, the second cut into MIG instances, overcommit 1.5."""
    VGPUHub.clear_instance()
    db = orm.new_session_factory(f"sqlite:///{tmp_path / 'hub.sqlite'}")()
    for name in ("ada", "bob"):
        db.add(orm.User(name=name))
    db.commit()
    QuotaStore(db).put("user", "ada", Quota(16 * GiB, 30, 4 * GiB, 70))
    config = Config()
    config.GPUInventory.simulate = True
    config.GPUInventory.simulated_mig_profiles = {"1": ["3g.40gb", "1g.10gb"]}
    config.VGPUHub.overcommit_ratio = 1.5
    config.VGPUHub.idle_seconds = 90.0
    yield db, config
    VGPUHub.clear_instance()
    db.close()


def spawner_of(hub, name: str = "ada") -> Local:
    db, config = hub
    user = User(
        orm.User.find(db, name),
        settings={"spawner_class": Local, "hub": Hub(), "config": config, "base_url": "/"},
    )
    return user.spawners[""]


@pytest.mark.asyncio
async def test_a_shared_slice_carries_the_quota_and_the_hubs_settings(hub):
    spawner = spawner_of(hub)
    s = spawner.vgpu_place()
    assert (s.gpu_index, s.memory_limit, s.memory_request, s.compute_share, s.priority) == (
        0,
        16 * GiB,
        4 * GiB,
        30,
        70,
    )
    assert (s.isolation, s.overcommit_ratio, s.idle_seconds, s.simulated) == ("time-slicing", 1.5, 90.0, True)
    assert s.placement == spawner.vgpu_hub.placement
    assert s.high_watermark == spawner.vgpu_hub.high_watermark


@pytest.mark.asyncio
async def test_a_mig_slice_is_the_whole_instance_never_overcommitted(hub):
    spawner = spawner_of(hub)
    spawner.user_options = {"mig_profile": "1g.10gb"}
    s = spawner.vgpu_place()
    assert s.isolation == "mig"
    assert s.gpu_uuid.startswith("MIG-sim-")
    assert s.memory_limit == s.memory_request == s.gpu_memory
    assert (s.compute_share, s.priority, s.overcommit_ratio, s.idle_seconds) == (14, 70, 1.0, 90.0)


@pytest.mark.asyncio
async def test_the_slice_and_its_placement_come_back_after_a_restart(hub):
    spawner = spawner_of(hub)
    s = spawner.vgpu_place()
    state = spawner.get_state()
    assert state[adoption.KIND_KEY] == "local"
    assert "vgpu_where" not in state  # nothing beyond the slice on one host
    VGPUHub.clear_instance()
    again = spawner_of(hub)
    again.load_state(state)
    assert again.vgpu_slice == s
    assert again.vgpu_where == {}
    assert again.vgpu_hub.allocator.placements["ada/"].gpu_uuid == s.gpu_uuid


@pytest.mark.asyncio
async def test_a_saved_slice_on_an_unknown_device_is_dropped(hub):
    spawner = spawner_of(hub)
    spawner.vgpu_place()
    saved = spawner.get_state()
    saved["vgpu_slice"] = {**saved["vgpu_slice"], "gpu_uuid": "GPU-gone"}
    VGPUHub.clear_instance()
    again = spawner_of(hub)
    again.load_state(saved)
    assert again.vgpu_slice is None
    assert again.vgpu_hub.allocator.placements == {}


@pytest.mark.asyncio
async def test_another_kinds_running_server_is_recognised_not_loaded(hub):
    spawner = spawner_of(hub)
    slurm = {adoption.KIND_KEY: "slurm", "job_id": "12", "vgpu_slice": {"version": 2}}
    spawner.load_state(slurm)
    assert spawner._vgpu_foreign == slurm
    assert spawner.vgpu_slice is None
    assert spawner.pid == 0


def test_a_spawned_servers_kernels_use_unix_sockets_unless_told_otherwise(hub):
    spawner = spawner_of(hub)
    assert spawner.get_args() == ["--KernelManager.transport=ipc"]
    assert spawner.get_args() == ["--KernelManager.transport=ipc"], "asked again, added once"
    assert spawner.args == [], "the Spawner.args setting itself is left as it was"
    spawner.args = ["--ServerKernelManager.transport=tcp", "--debug"]
    assert spawner.get_args() == ["--ServerKernelManager.transport=tcp", "--debug"], "an admin's own wins"
    spawner.args = []
    spawner.vgpu_hub.kernel_transport = "tcp"
    assert spawner.get_args() == []
