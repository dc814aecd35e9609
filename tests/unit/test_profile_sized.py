"""Profile-sized slices on both cluster spawners (:mod:`hub_spawner.profiles`): one set of
sizing settings and checks, an override checked as an assignment is (``TraitError``),
the same form lines, a Slurm slice placed, saved and loaded back without a cluster, and
both spawners' ``load_state`` going through the mixin (a server another kind of
spawner saved is recognised, not loaded).

Real spawners of real Hub users, made as the Hub makes them; no cluster is contacted.
"""

from __future__ import annotations

import pytest

pytest.importorskip("kubespawner", reason="needs the kubernetes extra: pip install -e '.[kubernetes]'")
pytest.importorskip("batchspawner", reason="needs the slurm extra: pip install -e '.[slurm]'")

from traitlets import TraitError, validate
from traitlets.config import Config

from hub_spawner import adoption, slurm_nodes
from hub_spawner.config import VGPUHub
from hub_spawner.kube import VGPUKubeSpawner
from hub_spawner.profiles import ProfileSizedSlice, QuotaExceeded, Size, describe, size
from hub_spawner.quotas import Effective, Quota, QuotaStore
from hub_spawner.slurm import VGPUSlurmSpawner
from hub_spawner.spawner import VGPUSpawnerMixin
from tests.kube import new_hub_db, spawner_of, use_kubeconfig

GiB = 2**30
NODES = "NodeName=vgpu-n1 Gres=gpu:2,shard:32 NodeAddr=10.213.0.11 State=IDLE Partitions=gpu \n"
SPAWNERS = [VGPUKubeSpawner, VGPUSlurmSpawner]
OVERRIDES = {VGPUKubeSpawner: "kubespawner_override", VGPUSlurmSpawner: "spawner_override"}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hub database (ada: 16 GiB, 8 GiB guaranteed, 50%, priority 60), a simulated
    Slurm node of two 16 GiB GPUs, and a config for both spawners."""
    use_kubeconfig(monkeypatch, tmp_path)
    VGPUHub.clear_instance()
    monkeypatch.setattr(VGPUKubeSpawner, "_claims", {})
    monkeypatch.setattr(VGPUSlurmSpawner, "_nodes", {})
    db = new_hub_db(tmp_path / "hub.sqlite", users=("ada", "bob"))
    QuotaStore(db).put("user", "ada", Quota(16 * GiB, 50, 8 * GiB, 60))
    config = Config()
    config.GPUInventory.source = "nodes"
    config.VGPUHub.overcommit_ratio = 2.0
    yield db, config
    VGPUHub.clear_instance()
    db.close()


def profiles(spawner_class, **override):
    key = OVERRIDES[spawner_class]
    small = {"vgpu_memory_limit": "4G", "vgpu_compute_share": 25}
    return [
        {"display_name": "Default", "slug": "default", "default": True},
        {"display_name": "Small", "slug": "small", key: small},
        {"display_name": "Big", "slug": "big", key: {"vgpu_memory_limit": "64G"}},
        {"display_name": "Odd", "slug": "odd", key: override},
    ]


def test_the_sizing_settings_are_defined_once():
    for name in ("vgpu_memory_limit", "vgpu_memory_request", "vgpu_compute_share", "vgpu_priority"):
        for spawner_class in SPAWNERS:
            assert spawner_class.class_traits()[name] is ProfileSizedSlice.class_traits()[name]
    # where only the help differs per platform, each says its own
    kube, slurm = (c.class_traits()["vgpu_gpu_memory"].help for c in SPAWNERS)
    assert "None: the budget" in kube
    assert "takes no slice" in slurm


@pytest.mark.asyncio
@pytest.mark.parametrize("spawner_class", SPAWNERS)
@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("vgpu_compute_share", 0, "vgpu_compute_share must be 1-100, not 0"),
        ("vgpu_compute_share", 101, "vgpu_compute_share must be 1-100, not 101"),
        ("vgpu_priority", 101, "vgpu_priority must be 0-100, not 101"),
        ("vgpu_priority", -1, "vgpu_priority must be 0-100, not -1"),
    ],
)
async def test_an_out_of_range_override_raises_trait_error(hub, spawner_class, setting, value, message):
    db, config = hub
    getattr(config, spawner_class.__name__).profile_list = profiles(spawner_class, **{setting: value})
    spawner = spawner_of(db, "ada", spawner_class, config)
    with pytest.raises(TraitError, match=message):
        spawner.vgpu_ask({setting: value})
    with pytest.raises(TraitError, match=message):
        spawner.vgpu_check_choice({"profile": "odd"})
    with pytest.raises(TraitError, match=message):  # as an assignment says it
        setattr(spawner, setting, value)
    form = await spawner.get_options_form()
    assert f"Misconfigured, ask an admin: {message}" in form
    assert "vGPU: 4.00 GiB budget, all of it guaranteed" in form
    assert "Above your vGPU quota: It asks for a vGPU budget of 64.00 GiB" in form


@pytest.mark.asyncio
@pytest.mark.parametrize("spawner_class", SPAWNERS)
async def test_an_override_is_converted_and_checked_as_an_assignment_is(hub, spawner_class):
    db, config = hub
    spawner = spawner_of(db, "ada", spawner_class, config)
    assert spawner.vgpu_setting("vgpu_memory_limit", "4G") == 4 * GiB
    assert spawner.vgpu_setting("vgpu_priority", None) is None
    ask = spawner.vgpu_ask({"vgpu_memory_request": "1G", "vgpu_priority": 7, "req_partition": "gpu"})
    assert (ask["memory_limit"], ask["memory_request"], ask["priority"]) == (None, GiB, 7)
    assert ask["mode"] == ("hami" if spawner_class is VGPUKubeSpawner else "shard")
    with pytest.raises(TraitError, match="not a valid memory specification"):
        spawner.vgpu_setting("vgpu_memory_limit", "lots")
    with pytest.raises(TraitError):
        spawner.vgpu_setting("vgpu_compute_share", "half")


@pytest.mark.asyncio
async def test_a_subclass_check_applies_to_overrides_too(hub):
    class Even(VGPUSlurmSpawner):
        @validate("vgpu_compute_share")
        def _even(self, proposal):
            if proposal.value is not None and proposal.value % 2:
                raise TraitError("an even share, please")
            return proposal.value

    db, config = hub
    spawner = spawner_of(db, "ada", Even, config)
    assert spawner.vgpu_setting("vgpu_compute_share", 40) == 40
    with pytest.raises(TraitError, match="an even share"):
        spawner.vgpu_setting("vgpu_compute_share", 41)


def test_sizes_capped_by_the_quota_field_by_field():
    quota = Effective(16 * GiB, 50, 8 * GiB, 60, {})
    none = {"memory_limit": None, "memory_request": None, "compute_share": None, "priority": None}
    assert size(none, quota) == Size(16 * GiB, 8 * GiB, 50, 60)
    assert size({**none, "memory_limit": 4 * GiB}, quota) == Size(4 * GiB, 4 * GiB, 50, 60)
    with pytest.raises(QuotaExceeded, match=r"^This profile asks for a compute share of 80%") as e:
        size({**none, "compute_share": 80}, quota)
    assert e.value.jupyterhub_message == str(e.value)
    with pytest.raises(QuotaExceeded, match=r"6\.00 GiB guaranteed, more than its budget of 4\.00 GiB"):
        size({**none, "memory_limit": 4 * GiB, "memory_request": 6 * GiB}, quota)
    assert (
        describe(Size(8 * GiB, 4 * GiB, 50, 60), "mps")
        == "vGPU: 8.00 GiB budget, 4.00 GiB guaranteed; compute share 50% under MPS, not enforced "
        "(set in the server's environment); priority 60"
    )
    assert describe(Size(80 * GiB, 80 * GiB, 50, 60), "time-slicing", whole=True).startswith(
        "vGPU: 80.00 GiB budget, on a whole GPU, all of it guaranteed"
    )


class NoAccounts(VGPUSlurmSpawner):
    """Hub users who are not Unix accounts here (batchspawner looks up their home)."""

    def user_env(self, env):
        env["USER"] = self.user.name
        return env


def slurm_spawner(hub, name="ada", spawner_class=NoAccounts):
    """A Slurm spawner whose allocator has the simulated node's two GPUs (as the last
    look at Slurm found them), without running scontrol."""
    db, config = hub
    spawner = spawner_of(db, name, spawner_class, config)
    nodes = slurm_nodes.parse_nodes(NODES)
    VGPUSlurmSpawner._nodes = {n.name: n for n in nodes}
    found, _ = slurm_nodes.devices(nodes, {}, simulate=True, simulated_memory=16 * GiB, simulated_name="sim")
    spawner.vgpu_hub.allocator.gpus = found
    return spawner


@pytest.mark.asyncio
async def test_a_slurm_slice_is_placed_saved_and_loaded_back(hub):
    db, config = hub
    config.VGPUSlurmSpawner.profile_list = profiles(VGPUSlurmSpawner)
    config.VGPUSlurmSpawner.vgpu_arbiter_socket = "/run/vgpu/{node}/arbiter.sock"
    config.VGPUHub.arbiter_socket = "/srv/hub-host/arbiter.sock"
    config.VGPUHub.isolation = "mps"  # the Hub host's: no MPS pipes on a node
    spawner = slurm_spawner(hub)
    spawner.user_options = {"profile": "small"}
    spawner._vgpu_apply_profile()
    s = spawner.vgpu_place()
    assert (s.gpu_uuid, s.memory_limit, s.memory_request, s.compute_share, s.priority) == (
        "GPU-sim-vgpu-n1-0",
        4 * GiB,
        4 * GiB,
        25,
        60,
    )
    assert (s.isolation, s.simulated, s.overcommit_ratio) == ("time-slicing", True, 2.0)
    hub_settings = spawner.vgpu_hub
    assert (s.placement, s.idle_seconds, s.high_watermark) == (
        hub_settings.placement,
        hub_settings.idle_seconds,
        hub_settings.high_watermark,
    )
    assert spawner.vgpu_where["gres"] == "shard:4"  # 4 GiB guaranteed, 1 GiB shards
    # the node's arbiter, not the Hub host's; Slurm shows the job its GPU
    env = spawner.get_env()
    assert env["JUPYTER_VGPU_ARBITER"] == "/run/vgpu/vgpu-n1/arbiter.sock"
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert "CUDA_MPS_PIPE_DIRECTORY" not in env
    assert env["CUPY_GPU_MEMORY_LIMIT"] == str(4 * GiB)
    spawner.job_id = spawner.vgpu_where["job_id"] = "12"
    state = spawner.get_state()
    assert state["vgpu_where"]["node"] == "vgpu-n1"
    assert state[adoption.KIND_KEY] == "slurm"

    # a Hub started again: the slice, where it runs and its placement come back
    VGPUHub.clear_instance()
    again = spawner_of(db, "ada", VGPUSlurmSpawner, config)
    again.load_state(state)
    assert again.vgpu_slice == s
    assert again.job_id == "12"  # batchspawner's own state, through the chain
    assert again.vgpu_where == state["vgpu_where"]
    allocator = again.vgpu_hub.allocator
    assert allocator.placements["ada/"].gpu_uuid == s.gpu_uuid
    assert [(g.uuid, g.node) for g in allocator.gpus] == [(s.gpu_uuid, "vgpu-n1")]
    again.vgpu_release()
    assert (again.vgpu_slice, again.vgpu_where, allocator.placements) == (None, {}, {})


@pytest.mark.asyncio
async def test_a_slurm_choice_above_the_quota_is_refused(hub):
    _, config = hub
    config.VGPUSlurmSpawner.profile_list = profiles(VGPUSlurmSpawner)
    spawner = slurm_spawner(hub)
    with pytest.raises(QuotaExceeded, match=r"^The profile 'big' asks for a vGPU budget of 64\.00 GiB"):
        spawner.run_options_from_form({"profile": ["big"]})
    assert spawner.run_options_from_form({"profile": ["small"]}) == {"profile": "small"}
    spawner.user_options = {"profile": "nope"}
    with pytest.raises(QuotaExceeded, match="No profile 'nope'"):
        spawner._vgpu_apply_profile()


@pytest.mark.asyncio
@pytest.mark.parametrize("spawner_class", SPAWNERS)
@pytest.mark.parametrize(
    "foreign",
    [
        {adoption.KIND_KEY: "local", "pid": 4321, "vgpu_slice": {"version": 2}},
        {"pid": 4321},  # saved before the kind was recorded: a local process
    ],
)
async def test_both_spawners_load_state_through_the_mixin(hub, monkeypatch, spawner_class, foreign):
    db, config = hub
    calls = []
    chain = VGPUSpawnerMixin.load_state

    def spy(self, state):
        calls.append(type(self).__name__)
        return chain(self, state)

    monkeypatch.setattr(VGPUSpawnerMixin, "load_state", spy)
    spawner = spawner_of(db, "ada", spawner_class, config)  # the Hub loads its (empty) state
    assert calls == [spawner_class.__name__]
    spawner.load_state(dict(foreign))
    assert calls == [spawner_class.__name__] * 2
    # another kind's running server: kept to be ended by poll(), nothing of it loaded
    assert spawner._vgpu_foreign == foreign
    assert spawner.vgpu_slice is None
    assert not getattr(spawner, "pid", 0)
    assert not getattr(spawner, "job_id", "")


@pytest.mark.asyncio
@pytest.mark.parametrize("spawner_class", SPAWNERS)
async def test_an_unusable_saved_slice_is_dropped_on_both(hub, spawner_class, caplog):
    db, config = hub
    spawner = spawner_of(db, "ada", spawner_class, config)
    kind = "kube" if spawner_class is VGPUKubeSpawner else "slurm"
    spawner.load_state({adoption.KIND_KEY: kind, "vgpu_slice": {"version": 2, "gpu_uuid": "x"}})
    assert spawner._vgpu_foreign is None
    assert spawner.vgpu_slice is None
    assert "Dropping unusable saved vGPU slice" in caplog.text


@pytest.mark.asyncio
async def test_a_slurm_slice_of_two_cards_takes_two_whole_gpus_of_one_node(hub):
    db, config = hub
    pair = {"vgpu_gres": "gpu", "vgpu_gpu_count": 2}
    config.VGPUSlurmSpawner.profile_list = [
        {"display_name": "Default", "slug": "default", "default": True},
        {"display_name": "Pair", "slug": "pair", "spawner_override": pair},
        {"display_name": "Shard pair", "slug": "shard-pair", "spawner_override": {"vgpu_gpu_count": 2}},
    ]
    spawner = slurm_spawner(hub)
    with pytest.raises(
        QuotaExceeded, match=r"^The profile 'pair' asks for a slice of 2 GPUs, more than your quota's 1 GPU"
    ):
        spawner.run_options_from_form({"profile": ["pair"]})
    QuotaStore(db).put("user", "ada", Quota(16 * GiB, 50, 8 * GiB, 60, 2))
    spawner = slurm_spawner(hub)
    form = await spawner.get_options_form()
    assert "vGPU: 2 GPUs, 16.00 GiB budget on each, whole GPUs, all of it guaranteed" in form
    assert "Misconfigured, ask an admin: a slice of 2 GPUs takes whole GPUs on Slurm" in form
    spawner.user_options = {"profile": "shard-pair"}
    spawner._vgpu_apply_profile()
    with pytest.raises(ValueError, match="vgpu_gres 'gpu'"):
        spawner.vgpu_place()
    spawner.user_options = {"profile": "pair"}
    spawner._vgpu_apply_profile()
    s = spawner.vgpu_place()
    assert s.gpu_uuids == ("GPU-sim-vgpu-n1-0", "GPU-sim-vgpu-n1-1")
    assert (s.memory_limit, s.memory_request) == (16 * GiB, 16 * GiB)  # each card whole
    assert spawner.vgpu_where["gres"] == "gpu:2"
    placement = spawner.vgpu_hub.allocator.placements["ada/"]
    assert placement.gpu_uuids == s.gpu_uuids
    # Slurm naming one GPU of the two moves nothing: never half located
    spawner.vgpu_locate(slurm_nodes.JobPlace("RUNNING", "", "vgpu-n1", (1,)))
    assert spawner.vgpu_slice.gpu_uuids == s.gpu_uuids
    spawner.job_id = spawner.vgpu_where["job_id"] = "14"
    state = spawner.get_state()
    VGPUHub.clear_instance()
    again = spawner_of(db, "ada", VGPUSlurmSpawner, config)
    again.load_state(state)
    assert again.vgpu_slice == s
    assert again.vgpu_hub.allocator.placements["ada/"].gpu_uuids == s.gpu_uuids
