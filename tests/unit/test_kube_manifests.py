"""deploy/kubernetes/: every manifest parses and survives its Kubernetes API model, the
pieces agree with each other and with the code (socket path, token key, scope, claim
names), and the Zero to JupyterHub values configure a Hub whose every profile gives a
valid pod."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("kubespawner", reason="needs the kubernetes extra: pip install -e '.[kubernetes]'")
pytest.importorskip("kubernetes_asyncio", reason="needs the kubernetes extra: pip install -e '.[kubernetes]'")
pytest.importorskip("yaml", reason="needs the kubernetes extra: pip install -e '.[kubernetes]'")

import yaml
from kubernetes_asyncio.client import ApiClient
from traitlets.config import Config

from hub_spawner.api import NODES_SCOPE
from hub_spawner.config import VGPUHub
from hub_spawner.kube import VGPUKubeSpawner
from hub_spawner.kube_modes import DRA_STRATEGIES
from hub_spawner.quotas import Quota, QuotaStore
from jupyter_vgpu.node.app import NODE_ENV
from tests.kube import MODELS, new_hub_db, round_trip, round_trip_async, spawner_of, use_kubeconfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
MANIFESTS = sorted(p for p in DEPLOY.glob("*.yaml") if p.name != "z2jh-values.yaml")
GiB = 2**30


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text(encoding="utf-8")) if d]


def one(name: str, kind: str) -> dict:
    (doc,) = [d for d in documents(name) if d["kind"] == kind]
    return doc


def test_the_folder_holds_what_the_readme_names():
    assert {p.name for p in DEPLOY.glob("*.yaml")} == {
        "arbiter-daemonset.yaml",
        "hub-rbac.yaml",
        "dra-claims.yaml",
        "z2jh-values.yaml",
    }


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_survives_its_kubernetes_model(path):
    docs = documents(path.name)
    assert docs
    for doc in docs:
        assert (doc["apiVersion"], doc["kind"]) in MODELS, f"{path.name}: no model for {doc['kind']}"
        assert round_trip(doc) == doc, f"{path.name}: {doc['kind']} {doc['metadata']['name']} changed"


def test_a_misspelled_field_would_be_caught():
    daemonset = one("arbiter-daemonset.yaml", "DaemonSet")
    daemonset["spec"]["template"]["spec"]["hostPid"] = True  # hostPID
    assert round_trip(daemonset) != daemonset


def test_the_daemonset_serves_the_socket_the_notebooks_mount_and_sees_host_pids():
    daemonset = one("arbiter-daemonset.yaml", "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    socket = VGPUKubeSpawner.vgpu_arbiter_socket.default_value
    assert f"--socket={socket}" in container["command"]
    assert container["command"][0] == "jupyter-vgpu-arbiter"  # pyproject's [project.scripts]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(Path(socket).parent)]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["hostPath"] == {"path": str(Path(socket).parent), "type": "DirectoryOrCreate"}
    env = {e["name"]: e for e in container["env"]}
    assert env[NODE_ENV]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["JUPYTERHUB_API_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "hub",
        "key": "hub.services.vgpu-arbiter.apiToken",  # where Zero to JupyterHub keeps a service's token
    }
    security = container["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["KILL", "SYS_PTRACE"]}
    assert security["allowPrivilegeEscalation"] is False
    assert "nvidia.com/gpu" not in str(container["resources"])  # takes no GPU from users
    assert daemonset["spec"]["template"]["metadata"]["labels"]["hub.jupyter.org/network-access-hub"] == "true"


def test_the_hub_may_read_nodes_and_nothing_more():
    role = one("hub-rbac.yaml", "ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    binding = one("hub-rbac.yaml", "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "hub", "namespace": "jhub"}]


def test_the_claims_are_the_spawners_defaults_with_the_drivers_sharing_strategies():
    templates = {
        d["metadata"]["name"]: d for d in documents("dra-claims.yaml") if d["kind"] == "ResourceClaimTemplate"
    }
    defaults = VGPUKubeSpawner.class_traits()["vgpu_dra_claim_templates"].default()
    assert set(templates) == set(defaults.values())
    for sharing, name in defaults.items():
        devices = templates[name]["spec"]["spec"]["devices"]
        assert devices["requests"] == [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]
        (config,) = devices["config"]
        assert config["opaque"]["driver"] == "gpu.nvidia.com"
        parameters = config["opaque"]["parameters"]
        assert (parameters["apiVersion"], parameters["kind"]) == ("resource.nvidia.com/v1beta1", "GpuConfig")
        assert parameters["sharing"]["strategy"] == DRA_STRATEGIES[sharing]
    shared = one("dra-claims.yaml", "ResourceClaim")
    assert shared["spec"]["devices"]["config"][0]["opaque"]["parameters"]["sharing"]["strategy"] == "MPS"


@pytest.fixture
def values():
    return yaml.safe_load((DEPLOY / "z2jh-values.yaml").read_text(encoding="utf-8"))


def test_the_values_give_the_arbiters_token_its_scopes(values):
    hub = values["hub"]
    assert "vgpu-arbiter" in hub["services"]
    role = hub["loadRoles"]["vgpu-arbiter"]
    assert role["services"] == ["vgpu-arbiter"]
    assert set(role["scopes"]) == {"read:users", NODES_SCOPE}


def test_the_values_extra_config_sets_up_the_kubernetes_hub(values):
    c = Config()
    exec(compile(values["hub"]["extraConfig"]["jupyter-vgpu"], "extraConfig", "exec"), {"c": c})
    assert c.JupyterHub.spawner_class == "vgpu-kube"
    assert c.GPUInventory.source == "nodes"
    assert NODES_SCOPE in c.JupyterHub.custom_scopes
    assert c.VGPUKubeSpawner.vgpu_mode == "hami"
    assert [h[0] for h in c.JupyterHub.extra_handlers if h[0].startswith("/api/vgpu/nodes")] == [
        "/api/vgpu/nodes",
        r"/api/vgpu/nodes/([^/]+)",
    ]


@pytest.mark.asyncio
async def test_every_profile_of_the_values_gives_a_valid_pod(values, tmp_path, monkeypatch):
    use_kubeconfig(monkeypatch, tmp_path)
    VGPUHub.clear_instance()
    db = new_hub_db(tmp_path / "hub.sqlite")
    QuotaStore(db).put("user", "ada", Quota(80 * GiB, 100, None, 50))
    config = Config()
    exec(compile(values["hub"]["extraConfig"]["jupyter-vgpu"], "extraConfig", "exec"), {"c": config})
    config.KubeSpawner.image = "{name}:{tag}".format(**values["singleuser"]["image"])
    config.KubeSpawner.profile_list = values["singleuser"]["profileList"]
    modes = set()
    try:
        for profile in values["singleuser"]["profileList"]:
            spawner = spawner_of(db, "ada", VGPUKubeSpawner, config)
            spawner.user_options = {"profile": profile["slug"]}
            await spawner.load_user_options()
            async with ApiClient() as client:
                pod = client.sanitize_for_serialization(await spawner.get_pod_manifest())
            assert await round_trip_async(pod, "V1Pod") == pod, profile["slug"]
            modes.add(pod["metadata"]["labels"]["jupyter-vgpu/mode"])
            spawner.vgpu_release()
    finally:
        VGPUHub.clear_instance()
        db.close()
    assert modes == {"hami", "mig", "dra", "whole"}
