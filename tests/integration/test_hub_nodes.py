"""Node arbiters' reports through the real demo hub: only a token with
``custom:vgpu-nodes:write`` may report, a report breaking its contract or naming another
node is refused with the field, and a reported node's GPUs join the Hub's inventory."""

from __future__ import annotations

import pytest

from jupyter_vgpu.node import report
from jupyter_vgpu.testing.hub_process import HubProcess

GiB = 2**30
TOKEN = "arbiter-token-for-the-node-tests-0123456789"


@pytest.fixture(scope="module")
def hub():
    process = HubProcess("nodes-hub", {"JUPYTER_VGPU_DEMO_NODE_TOKEN": TOKEN})
    try:
        process.start()
        yield process
    finally:
        process.shutdown()


def node_report(node: str = "gpu-node-1") -> dict:
    devices = [
        {
            "uuid": "GPU-11111111-2222-3333-4444-555555555555",
            "index": 0,
            "name": "NVIDIA H100 80GB HBM3",
            "memory": 80 * GiB,
            "used": 76 * GiB,
            "mig_profile": None,
            "compute_percent": None,
        }
    ]
    return report.build(node, devices, {}, [], watermark=0.9, pod_of=lambda pid: None)


def test_only_the_arbiters_scope_may_report(hub):
    body = node_report()
    assert (
        hub.api("POST", "/vgpu/nodes/gpu-node-1", headers={"Authorization": ""}, json=body).status_code == 403
    )
    refused = hub.api("POST", "/vgpu/nodes/gpu-node-1", json=body)  # the admin's token
    assert refused.status_code == 403
    assert "custom:vgpu-nodes:write" in refused.json()["message"]
    ada = hub.user_token("ada")
    assert hub.api("POST", "/vgpu/nodes/gpu-node-1", token=ada, json=body).status_code == 403


@pytest.mark.parametrize(
    ("path", "change", "message"),
    [
        ("/vgpu/nodes/gpu-node-1", {"gpus": [{"uuid": "GPU-x"}]}, "gpus[0]: missing field(s): index"),
        ("/vgpu/nodes/gpu-node-2", {}, "node: must be the node in the URL, 'gpu-node-2'"),
        ("/vgpu/nodes/gpu-node-1", {"version": 2}, "version: must be 1"),
    ],
)
def test_a_report_breaking_its_contract_is_refused_with_the_field(hub, path, change, message):
    r = hub.api("POST", path, token=TOKEN, json={**node_report(), **change})
    assert r.status_code == 400
    assert message in r.json()["message"]


def test_a_reported_node_joins_the_inventory(hub):
    assert hub.api("POST", "/vgpu/nodes/gpu-node-1", token=TOKEN, json=node_report()).status_code == 204
    nodes = hub.api("GET", "/vgpu/nodes").json()["nodes"]
    node = nodes["gpu-node-1"]
    assert node["source"] == "arbiter"
    assert node["stale"] is False
    assert node["pressure"] == ["GPU-11111111-2222-3333-4444-555555555555"]  # 76 of 80 GiB > 0.9
    assert [(d["uuid"], d["node"], d["memory"]) for d in node["devices"]] == [
        ("GPU-11111111-2222-3333-4444-555555555555", "gpu-node-1", 80 * GiB)
    ]
    gpus = hub.api("GET", "/vgpu/usage").json()["gpus"]
    assert "gpu-node-1 GPU 0" in [g["label"] for g in gpus]
    assert hub.api("GET", "/vgpu/nodes", token=hub.user_token("ada")).status_code == 403
    # the arbiters' token also reads the slices (its Hub link)
    assert hub.api("GET", "/vgpu/slices", token=TOKEN).status_code == 200
