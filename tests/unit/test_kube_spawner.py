"""VGPUKubeSpawner: KubeSpawner's real pod manifests for every sharing mode and a few
profile_list choices, checked field by field and against the Kubernetes API's models;
the spawn form's choice flowing into the slice; choices above the quota refused.

No cluster: the pods are built by KubeSpawner's own ``get_pod_manifest()`` for real Hub
users in a real Hub database, and never sent.
"""

from __future__ import annotations

import html
import json

import pytest

pytest.importorskip("kubespawner", reason="needs the kubernetes extra: pip install -e '.[kubernetes]'")
pytest.importorskip("kubernetes_asyncio", reason="needs the kubernetes extra: pip install -e '.[kubernetes]'")

from kubernetes_asyncio.client import ApiClient
from traitlets.config import Config

from hub_spawner.config import VGPUHub
from hub_spawner.kube import PENDING, VGPUKubeSpawner
from hub_spawner.kube_modes import HAMI_ALLOCATED
from hub_spawner.nodes import NodeBoard, parse_report
from hub_spawner.profiles import QuotaExceeded
from hub_spawner.quotas import Quota, QuotaStore
from jupyter_vgpu.slice import Slice
from tests.kube import new_hub_db, round_trip_async, spawner_of, use_kubeconfig

GiB = 2**30
MiB = 2**20

PROFILES = [
    {"display_name": "Default", "slug": "default", "default": True},
    {
        "display_name": "Small GPU",
        "slug": "small",
        "kubespawner_override": {"vgpu_memory_limit": "4G", "vgpu_compute_share": 25, "image": "small:1"},
    },
    {
        "display_name": "Sized",
        "slug": "sized",
        "kubespawner_override": {"vgpu_mode": "hami"},
        "profile_options": {
            "memory": {
                "display_name": "GPU memory",
                "choices": {
                    "2g": {"display_name": "2 GiB", "kubespawner_override": {"vgpu_memory_limit": "2G"}},
                    "6g": {
                        "display_name": "6 GiB",
                        "default": True,
                        "kubespawner_override": {"vgpu_memory_limit": "6G", "vgpu_memory_request": "3G"},
                    },
                    "64g": {"display_name": "64 GiB", "kubespawner_override": {"vgpu_memory_limit": "64G"}},
                },
            }
        },
    },
    {
        "display_name": "MIG 1g",
        "slug": "mig-small",
        "kubespawner_override": {"vgpu_mode": "mig", "vgpu_mig_profile": "1g.10gb"},
    },
    {
        "display_name": "MIG 7g",
        "slug": "mig-big",
        "kubespawner_override": {"vgpu_mode": "mig", "vgpu_mig_profile": "7g.80gb"},
    },
    {
        "display_name": "MPS",
        "slug": "mps",
        "kubespawner_override": {"vgpu_mode": "dra", "vgpu_dra_sharing": "mps", "vgpu_gpu_memory": "80G"},
    },
    {"display_name": "High priority", "slug": "vip", "kubespawner_override": {"vgpu_priority": 90}},
]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hub database (ada with a 16 GiB quota, 8 GiB guaranteed, 50%, priority 60) and
    a config for the Kubernetes spawner; no cluster."""
    use_kubeconfig(monkeypatch, tmp_path)
    VGPUHub.clear_instance()
    monkeypatch.setattr(VGPUKubeSpawner, "_claims", {})
    db = new_hub_db(tmp_path / "hub.sqlite", users=("ada", "bob", "cy"))
    QuotaStore(db).put("user", "ada", Quota(16 * GiB, 50, 8 * GiB, 60))
    config = Config()
    config.KubeSpawner.image = "quay.io/jupyter/base-notebook:2025-01-06"
    config.GPUInventory.source = "nodes"
    config.VGPUHub.arbiter_socket = "/srv/hub-host/arbiter.sock"  # a single host's, never a pod's
    yield db, config
    VGPUHub.clear_instance()
    db.close()


async def spawn_pod(hub, user_options=None, **settings):
    """The pod KubeSpawner would create for ada (with these spawner settings), as the
    API would receive it, after checking it against the API's models."""
    db, config = hub
    for key, value in settings.items():
        setattr(config.VGPUKubeSpawner, key, value)
    spawner = spawner_of(db, "ada", VGPUKubeSpawner, config)
    spawner.user_options = user_options or {}
    await spawner.load_user_options()
    pod = await spawner.get_pod_manifest()
    async with ApiClient() as client:
        document = client.sanitize_for_serialization(pod)
    assert await round_trip_async(document, "V1Pod") == document, "the pod does not survive the V1Pod model"
    return spawner, document


def notebook(document: dict) -> dict:
    (container,) = [c for c in document["spec"]["containers"] if c["name"] == "notebook"]
    return container


def env_of(document: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in notebook(document)["env"]}


def slice_of(document: dict) -> Slice:
    return Slice.from_json(env_of(document)["JUPYTER_VGPU_SLICE"])


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("settings", "limits", "isolation"),
    [
        ({"vgpu_mode": "whole"}, {"nvidia.com/gpu": "1"}, "time-slicing"),
        (
            {"vgpu_mode": "mig", "vgpu_mig_profile": "1g.10gb"},
            {"nvidia.com/mig-1g.10gb": "1"},
            "mig",
        ),
        (
            {"vgpu_mode": "hami"},
            {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(16 * 1024), "nvidia.com/gpucores": "50"},
            "time-slicing",
        ),
        ({"vgpu_mode": "dra"}, {}, "time-slicing"),
        ({"vgpu_mode": "dra", "vgpu_dra_sharing": "mps"}, {}, "mps"),
    ],
)
async def test_every_mode_puts_its_gpu_request_and_the_slice_in_the_pod(hub, settings, limits, isolation):
    spawner, pod = await spawn_pod(hub, **settings)
    container = notebook(pod)
    assert container["resources"]["limits"] == limits
    assert container["resources"]["requests"] == {}  # extended resources: the limit is the request
    assert pod["metadata"]["labels"]["jupyter-vgpu/mode"] == settings["vgpu_mode"]
    if settings["vgpu_mode"] == "dra":
        template = "vgpu-mps" if isolation == "mps" else "vgpu-time-slicing"
        assert pod["spec"]["resourceClaims"] == [{"name": "vgpu", "resourceClaimTemplateName": template}]
        assert container["resources"]["claims"] == [{"name": "vgpu"}]
    else:
        assert "resourceClaims" not in pod["spec"]
        assert "claims" not in container["resources"]

    s = slice_of(pod)
    assert s == spawner.vgpu_slice
    assert s.isolation == isolation
    assert s.gpu_uuid == PENDING
    assert s.priority == 60
    if settings["vgpu_mode"] == "mig":
        assert (s.memory_limit, s.memory_request, s.compute_share, s.overcommit_ratio) == (
            10 * GiB,
            10 * GiB,
            14,
            1.0,
        )
    else:
        assert (s.memory_limit, s.memory_request, s.compute_share) == (16 * GiB, 8 * GiB, 50)
    env = env_of(pod)
    assert "CUDA_VISIBLE_DEVICES" not in env  # the device plugin / DRA driver chooses the device
    assert env["JUPYTER_VGPU_ARBITER"] == "/run/jupyter-vgpu/arbiter.sock"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in env  # the DRA driver's MPS daemon, not the arbiter's
    assert env["CUPY_GPU_MEMORY_LIMIT"] == str(s.memory_limit)
    if isolation == "mps":
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={16 * 1024}M"
    assert {
        "name": "vgpu-arbiter",
        "hostPath": {"path": "/run/jupyter-vgpu", "type": "DirectoryOrCreate"},
    } in pod["spec"]["volumes"]
    assert {"name": "vgpu-arbiter", "mountPath": "/run/jupyter-vgpu", "readOnly": True} in container[
        "volumeMounts"
    ]


@pytest.mark.asyncio
async def test_hami_sees_a_device_of_its_budget_and_gets_gpumem_in_whole_mib(hub):
    _, pod = await spawn_pod(
        hub, {"profile": "small"}, vgpu_mode="hami", profile_list=PROFILES, vgpu_memory_limit=None
    )
    limits = notebook(pod)["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096", "nvidia.com/gpucores": "25"}
    s = slice_of(pod)
    # HAMi-core shows the container a 4 GiB device: the whole budget is its memory fraction 1.0
    assert (s.gpu_memory, s.memory_limit, s.memory_fraction) == (4 * GiB, 4 * GiB, 1.0)
    assert env_of(pod)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "1.00"


@pytest.mark.asyncio
async def test_renamed_hami_resources_and_no_socket(hub):
    names = {"gpu": "example.com/vgpu", "memory": "example.com/vmem", "cores": "example.com/vcores"}
    _, pod = await spawn_pod(hub, vgpu_mode="hami", vgpu_hami_resources=names, vgpu_arbiter_socket="")
    assert notebook(pod)["resources"]["limits"] == {
        "example.com/vgpu": "1",
        "example.com/vmem": "16384",
        "example.com/vcores": "50",
    }
    assert "JUPYTER_VGPU_ARBITER" not in env_of(pod)
    assert not [v for v in pod["spec"]["volumes"] if v["name"] == "vgpu-arbiter"]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("options", "image", "limits", "sizes"),
    [
        ({}, "quay.io/jupyter/base-notebook:2025-01-06", {"nvidia.com/gpumem": "16384"}, (16, 8, 50, 60)),
        (
            {"profile": "small"},
            "small:1",
            {"nvidia.com/gpumem": "4096", "nvidia.com/gpucores": "25"},
            (4, 4, 25, 60),
        ),
        ({"profile": "sized"}, None, {"nvidia.com/gpumem": "6144"}, (6, 3, 50, 60)),
        ({"profile": "sized", "memory": "2g"}, None, {"nvidia.com/gpumem": "2048"}, (2, 2, 50, 60)),
    ],
)
async def test_the_chosen_profile_sizes_the_slice_and_the_pod(hub, options, image, limits, sizes):
    _spawner, pod = await spawn_pod(hub, options, profile_list=PROFILES)
    container = notebook(pod)
    if image:
        assert container["image"] == image
    for key, value in limits.items():
        assert container["resources"]["limits"][key] == value
    s = slice_of(pod)
    assert (s.memory_limit / GiB, s.memory_request / GiB, s.compute_share, s.priority) == sizes


@pytest.mark.asyncio
async def test_the_spawn_form_names_each_profiles_slice_and_marks_those_above_the_quota(hub):
    db, config = hub
    config.VGPUKubeSpawner.profile_list = PROFILES
    spawner = spawner_of(db, "ada", VGPUKubeSpawner, config)
    form = await spawner.get_options_form()
    assert (
        "vGPU: 4.00 GiB budget, all of it guaranteed; compute share 25% (enforced by HAMi); priority 60"
        in form
    )
    assert "vGPU: 6.00 GiB budget, 3.00 GiB guaranteed" in form  # the default choice of "sized"
    assert "vGPU: a whole MIG 1g.10gb instance (10.00 GiB)" in form
    assert "Above your vGPU quota: It asks for a MIG 7g.80gb instance (80.00 GiB)" in form
    assert "Above your vGPU quota: It asks for priority 90, more than your quota&#x27;s 60" in form
    assert 'name="profile"' in form  # KubeSpawner's own form


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("formdata", "message"),
    [
        (
            {"profile": ["sized"], "profile-option-sized--memory": ["64g"]},
            "The profile 'sized' asks for a vGPU budget of 64.00 GiB, more than your quota's 16.00 GiB",
        ),
        ({"profile": ["mig-big"]}, "The profile 'mig-big' asks for a MIG 7g.80gb instance (80.00 GiB)"),
        ({"profile": ["vip"]}, "The profile 'vip' asks for priority 90, more than your quota's 60"),
    ],
)
async def test_a_choice_above_the_quota_is_refused_on_the_form_and_at_start(hub, formdata, message):
    db, config = hub
    config.VGPUKubeSpawner.profile_list = PROFILES
    spawner = spawner_of(db, "ada", VGPUKubeSpawner, config)
    with pytest.raises(QuotaExceeded, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as e:
        spawner.run_options_from_form(formdata)
    assert e.value.jupyterhub_message == str(e.value)
    # the same choice through the REST API (no form) fails at start, before any pod exists
    spawner.user_options = {k: v[0] for k, v in formdata.items() if k == "profile"}
    if "profile-option-sized--memory" in formdata:
        spawner.user_options["memory"] = "64g"
    with pytest.raises(QuotaExceeded, match=message.split(",")[0].replace("(", r"\(").replace(")", r"\)")):
        await spawner.load_user_options()
    assert spawner.vgpu_slice is None


@pytest.mark.asyncio
async def test_a_misconfigured_profile_is_named_on_the_form_and_refused(hub):
    db, config = hub
    config.VGPUKubeSpawner.profile_list = [
        *PROFILES,
        {"display_name": "Broken", "slug": "broken", "kubespawner_override": {"vgpu_mode": "mig"}},
        {"display_name": "Typo", "slug": "typo", "kubespawner_override": {"vgpu_memory_limit": "lots"}},
    ]
    spawner = spawner_of(db, "ada", VGPUKubeSpawner, config)
    form = await spawner.get_options_form()
    assert "Misconfigured, ask an admin: vGPU mode &#x27;mig&#x27; needs a MIG profile" in form
    assert "Misconfigured, ask an admin:" in form.split("Typo")[1]
    with pytest.raises(ValueError, match="needs a MIG profile"):
        spawner.run_options_from_form({"profile": ["broken"]})


@pytest.mark.asyncio
async def test_a_choice_within_the_quota_passes_the_form(hub):
    db, config = hub
    config.VGPUKubeSpawner.profile_list = PROFILES
    spawner = spawner_of(db, "ada", VGPUKubeSpawner, config)
    options = spawner.run_options_from_form({"profile": ["sized"], "profile-option-sized--memory": ["2g"]})
    assert options == {"profile": "sized", "memory": "2g"}
    with pytest.raises(ValueError, match="No such profile: nope"):
        spawner.run_options_from_form({"profile": ["nope"]})


@pytest.mark.asyncio
async def test_a_group_quota_raises_what_a_user_may_pick(hub):
    db, config = hub
    store = QuotaStore(db)
    store.delete("user", "ada")
    from jupyterhub import orm

    group = orm.Group(name="big")
    db.add(group)
    group.users.append(orm.User.find(db, "ada"))
    db.commit()
    store.put("group", "big", Quota(80 * GiB, 100, None, 90))
    config.VGPUKubeSpawner.profile_list = PROFILES
    spawner = spawner_of(db, "ada", VGPUKubeSpawner, config)
    assert spawner.run_options_from_form({"profile": ["mig-big"]}) == {"profile": "mig-big"}
    spawner.user_options = {"profile": "vip"}
    await spawner.load_user_options()
    assert spawner.vgpu_slice.priority == 90


@pytest.mark.asyncio
async def test_where_the_pod_landed_hami_annotation_then_the_arbiters_report(hub):
    spawner, _ = await spawn_pod(hub, vgpu_mode="hami")
    pod = {
        "metadata": {
            "name": "jupyter-ada",
            "namespace": "jhub",
            "uid": "0b7e5c1e-1f4c-4c55-9d2e-2f6f3a0f1a11",
            "annotations": {"hami.io/vgpu-devices-allocated": "GPU-aaaa,NVIDIA,16384,50:;"},
        },
        "spec": {"nodeName": "gpu-node-1", "containers": [{"name": "notebook"}]},
    }
    spawner.vgpu_locate(pod)
    assert spawner.vgpu_slice.gpu_uuid == "GPU-aaaa"
    assert spawner.vgpu_listing() == {
        "node": "gpu-node-1",
        "namespace": "jhub",
        "pod": "jupyter-ada",
        "pod_uid": "0b7e5c1e-1f4c-4c55-9d2e-2f6f3a0f1a11",
        "resource_claim": None,
    }
    board = NodeBoard()
    board.record("gpu-node-1", parse_report("gpu-node-1", node_report("gpu-node-1", "GPU-zzzz", "GPU-aaaa")))
    assert spawner.vgpu_relocate(board)
    s = spawner.vgpu_slice
    assert (s.gpu_uuid, s.gpu_index, s.gpu_name) == ("GPU-aaaa", 1, "NVIDIA H100 80GB HBM3")
    assert s.gpu_memory == 16 * GiB  # HAMi's device as the container sees it, not the card
    state = spawner.get_state()
    assert state["vgpu_where"]["node"] == "gpu-node-1"
    again = spawner_of(hub[0], "bob", VGPUKubeSpawner, hub[1])
    again.load_state(state)
    assert again.vgpu_slice == s
    assert again.vgpu_listing()["pod_uid"] == "0b7e5c1e-1f4c-4c55-9d2e-2f6f3a0f1a11"


@pytest.mark.asyncio
async def test_a_dra_pod_takes_the_gpu_its_processes_use(hub):
    spawner, _ = await spawn_pod(hub, vgpu_mode="dra", vgpu_gpu_memory="80G")
    uid = "5d1a0c7e-0000-4000-8000-000000000001"
    spawner.vgpu_locate({"metadata": {"uid": uid, "name": "jupyter-ada"}, "spec": {"nodeName": "n2"}})
    assert spawner.vgpu_slice.gpu_uuid == PENDING  # two GPUs on n2, none used yet: unknown
    board = NodeBoard()
    board.record("n2", parse_report("n2", node_report("n2", "GPU-zzzz", "GPU-aaaa")))
    assert not spawner.vgpu_relocate(board)
    used = [{"uid": uid, "gpus": ["GPU-zzzz"], "kernels": 1}]
    board.record("n2", parse_report("n2", node_report("n2", "GPU-zzzz", "GPU-aaaa", pods=used)))
    assert spawner.vgpu_relocate(board)
    s = spawner.vgpu_slice
    assert (s.gpu_uuid, s.gpu_index, s.gpu_memory, s.memory_limit) == ("GPU-zzzz", 0, 80 * GiB, 16 * GiB)


@pytest.mark.asyncio
async def test_shared_dra_claims_let_users_share_a_gpu_and_fill_evenly(hub):
    db, config = hub
    config.VGPUKubeSpawner.vgpu_mode = "dra"
    config.VGPUKubeSpawner.vgpu_dra_sharing = "mps"
    config.VGPUKubeSpawner.vgpu_dra_shared_claims = {"mps": ["vgpu-mps-0", "vgpu-mps-1"]}
    claims = {}
    spawners = {}
    for name in ("ada", "bob", "cy"):
        spawner = spawners[name] = spawner_of(db, name, VGPUKubeSpawner, config)
        spawner.user_options = {}
        await spawner.load_user_options()
        async with ApiClient() as client:
            pod = client.sanitize_for_serialization(await spawner.get_pod_manifest())
        assert await round_trip_async(pod, "V1Pod") == pod
        (claim,) = pod["spec"]["resourceClaims"]
        claims[name] = claim
        assert notebook(pod)["resources"]["claims"] == [{"name": "vgpu"}]
        assert slice_of(pod).isolation == "mps"
    assert claims["ada"] == {"name": "vgpu", "resourceClaimName": "vgpu-mps-0"}
    assert claims["bob"] == {"name": "vgpu", "resourceClaimName": "vgpu-mps-1"}
    assert claims["cy"] == {"name": "vgpu", "resourceClaimName": "vgpu-mps-0"}
    spawners["bob"].vgpu_release()  # bob stops: vgpu-mps-1 has room again
    spawners["ada"].user_options = {}
    await spawners["ada"].load_user_options()  # ada respawns
    assert spawners["ada"].vgpu_claim == "vgpu-mps-1"
    # the claim survives a Hub restart in the spawner's state
    spawners["ada"].vgpu_where = {"node": "n", "namespace": "jhub", "pod": "p", "uid": "u"}
    state = spawners["ada"].get_state()
    VGPUKubeSpawner._claims.clear()
    again = spawner_of(db, "bob", VGPUKubeSpawner, config)
    again.load_state(state)
    assert again.vgpu_claim == "vgpu-mps-1"
    assert VGPUKubeSpawner._claims == {"vgpu-mps-1": {"bob/"}}


@pytest.mark.asyncio
async def test_a_quota_change_keeps_a_running_pods_sizes_and_follows_its_priority(hub):
    spawner, _ = await spawn_pod(hub, vgpu_mode="hami")
    db = hub[0]
    store = QuotaStore(db)
    store.put("user", "ada", Quota(2 * GiB, 10, None, 20))
    effective = spawner.vgpu_resolve()
    spawner.vgpu_check_update(effective)  # never refuses: nothing is resized
    spawner.vgpu_update(effective)
    s = spawner.vgpu_slice
    assert (s.memory_limit, s.compute_share, s.priority) == (16 * GiB, 50, 20)
    assert json.loads(json.dumps(spawner.orm_spawner.state))["vgpu_slice"]["priority"] == 20


def node_report(node, *uuids, pods=()):
    """A node arbiter's report (contract ``node-report``) of whole H100s."""
    return {
        "version": 1,
        "node": node,
        "gpus": [
            {
                "uuid": u,
                "index": i,
                "name": "NVIDIA H100 80GB HBM3",
                "memory": 80 * GiB,
                "used": 0,
                "mig_profile": None,
                "compute_percent": None,
                "pressure": False,
            }
            for i, u in enumerate(uuids)
        ],
        "pods": list(pods),
        "problems": [],
    }


# -- slices of several cards ----------------------------------------------------------


def pair_quota(hub, count=2):
    """Ada's quota lets her slices span ``count`` cards (16 GiB on each)."""
    QuotaStore(hub[0]).put("user", "ada", Quota(16 * GiB, 50, 8 * GiB, 60, count))


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("mode", "limits"),
    [
        ("whole", {"nvidia.com/gpu": "2"}),
        # HAMi's gpumem and gpucores hold on each of the container's devices
        ("hami", {"nvidia.com/gpu": "2", "nvidia.com/gpumem": str(16 * 1024), "nvidia.com/gpucores": "50"}),
    ],
)
async def test_a_profile_of_two_cards_asks_for_two_and_the_slice_holds_its_budget_on_each(hub, mode, limits):
    pair_quota(hub)
    spawner, pod = await spawn_pod(hub, vgpu_mode=mode, vgpu_gpu_count=2)
    assert notebook(pod)["resources"]["limits"] == limits
    s = slice_of(pod)
    # both cards unknown until the pod runs: placeholders, and the arbiter leaves it alone
    assert s.gpu_uuids == (PENDING, f"{PENDING}-1")
    assert (s.memory_limit, s.memory_request) == (16 * GiB, 8 * GiB)
    assert spawner.vgpu_describe().startswith("GPUs 0 and 1 (NVIDIA GPU")


@pytest.mark.asyncio
async def test_the_quota_bounds_the_card_count_and_one_device_modes_refuse_several(hub):
    db, config = hub
    pair = {"vgpu_gpu_count": 2}
    config.VGPUKubeSpawner.profile_list = [
        {"display_name": "One", "slug": "one", "default": True},
        {"display_name": "Pair", "slug": "pair", "kubespawner_override": {**pair, "vgpu_mode": "whole"}},
        {
            "display_name": "MIG pair",
            "slug": "mig-pair",
            "kubespawner_override": {**pair, "vgpu_mode": "mig", "vgpu_mig_profile": "1g.10gb"},
        },
        {
            "display_name": "DRA pair",
            "slug": "dra-pair",
            "kubespawner_override": {**pair, "vgpu_mode": "dra"},
        },
    ]
    spawner = spawner_of(db, "ada", VGPUKubeSpawner, config)
    form = html.unescape(await spawner.get_options_form())
    assert "Above your vGPU quota: It asks for a slice of 2 GPUs, more than your quota's 1 GPU" in form
    with pytest.raises(QuotaExceeded, match="The profile 'pair' asks for a slice of 2 GPUs"):
        spawner.run_options_from_form({"profile": ["pair"]})
    pair_quota(hub)
    spawner = spawner_of(db, "ada", VGPUKubeSpawner, config)
    form = html.unescape(await spawner.get_options_form())
    assert "vGPU: 2 GPUs, 16.00 GiB budget on each, whole GPUs, 8.00 GiB guaranteed" in form
    for mode in ("mig", "dra"):
        refusal = f"a slice of 2 GPUs needs vgpu_mode 'whole' or 'hami' (mode '{mode}' gives one device)"
        assert f"Misconfigured, ask an admin: {refusal}" in form
    with pytest.raises(ValueError, match="a slice of 2 GPUs needs vgpu_mode"):
        spawner.run_options_from_form({"profile": ["dra-pair"]})
    # the quota's count alone gives a one-device mode its one device
    spawner.user_options = {"profile": "one"}
    config.VGPUKubeSpawner.vgpu_mode = "dra"
    spawner = spawner_of(db, "ada", VGPUKubeSpawner, config)
    await spawner.load_user_options()
    assert len(spawner.vgpu_slice.gpu_uuids) == 1


@pytest.mark.asyncio
async def test_a_pod_of_two_cards_is_located_on_both_at_once_never_on_one(hub):
    pair_quota(hub)
    uid = "5d1a0c7e-0000-4000-8000-000000000002"
    meta = {"uid": uid, "name": "jupyter-ada", "namespace": "jhub"}
    # HAMi names every device of the container at once
    spawner, _ = await spawn_pod(hub, vgpu_mode="hami", vgpu_gpu_count=2)
    allocated = "GPU-bbbb,NVIDIA,16384,50:GPU-aaaa,NVIDIA,16384,50:;"
    spawner.vgpu_locate(
        {"metadata": {**meta, "annotations": {HAMI_ALLOCATED: allocated}}, "spec": {"nodeName": "n3"}}
    )
    assert spawner.vgpu_slice.gpu_uuids == ("GPU-bbbb", "GPU-aaaa")
    # whole cards on a node of four: known once the pod's processes used both
    spawner, _ = await spawn_pod(hub, vgpu_mode="whole", vgpu_gpu_count=2)
    spawner.vgpu_locate({"metadata": meta, "spec": {"nodeName": "n4"}})
    cards = ("GPU-0000", "GPU-1111", "GPU-2222", "GPU-3333")
    board = NodeBoard()
    used = [{"uid": uid, "gpus": ["GPU-2222"], "kernels": 1}]
    board.record("n4", parse_report("n4", node_report("n4", *cards, pods=used)))
    assert not spawner.vgpu_relocate(board)
    assert spawner.vgpu_slice.gpu_uuids == (PENDING, f"{PENDING}-1")  # never half located
    used = [{"uid": uid, "gpus": ["GPU-3333", "GPU-2222"], "kernels": 1}]
    board.record("n4", parse_report("n4", node_report("n4", *cards, pods=used)))
    assert spawner.vgpu_relocate(board)
    s = spawner.vgpu_slice
    assert (s.gpu_uuids, s.gpu_indices, s.gpu_memory) == (("GPU-2222", "GPU-3333"), (2, 3), 80 * GiB)
    assert [c.memory for c in s.more_gpus] == [80 * GiB]
    # on a node of exactly two cards, both are the pod's at once
    spawner, _ = await spawn_pod(hub, vgpu_mode="whole", vgpu_gpu_count=2)
    spawner.vgpu_locate({"metadata": meta, "spec": {"nodeName": "n2"}})
    board.record("n2", parse_report("n2", node_report("n2", "GPU-zzzz", "GPU-aaaa")))
    assert spawner.vgpu_relocate(board)
    assert spawner.vgpu_slice.gpu_uuids == ("GPU-zzzz", "GPU-aaaa")
