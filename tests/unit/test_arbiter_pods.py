"""The node arbiter on Kubernetes: servers known by their pod instead of a process
tree, the Hub's slices of this node's pods (read over HTTP as the arbiter reads them),
and the node report built from real processes.

The pod of a process comes from its cgroup (tests/unit/test_namespaces.py reads real
ones); here a stand-in says which real processes are in which pod, since this machine
runs no kubelet.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import tornado.web

from jupyter_vgpu import contracts, nvml
from jupyter_vgpu.node import report
from jupyter_vgpu.node.app import ArbiterApp, HubLink
from jupyter_vgpu.node.arbiter import Arbiter
from jupyter_vgpu.node.watchdog import Owner, owners
from jupyter_vgpu.slice import Slice

GiB = 2**30
ADA_POD, BOB_POD = "0b7e5c1e-1f4c-4c55-9d2e-2f6f3a0f1a11", "5d1a0c7e-0000-4000-8000-000000000001"
SLICE = Slice("GPU-aaaa", 0, "NVIDIA H100 80GB HBM3", 80 * GiB, 8 * GiB, 50)


@pytest.fixture
def pods():
    """Two real processes, one per pod (as the stand-in for their cgroups says)."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    yield {procs[0].pid: ADA_POD, procs[1].pid: BOB_POD}
    for p in procs:
        p.kill()
        p.wait()


def new_arbiter(pods: dict[int, str]) -> Arbiter:
    return Arbiter(ArbiterApp(registrars="none", over_budget="report"), pod_of=pods.get)


def test_on_kubernetes_the_arbiter_leaves_mps_to_the_dra_driver(monkeypatch):
    assert ArbiterApp().mps_daemons is True
    assert ArbiterApp(node_name="gpu-node-1").mps_daemons is False
    monkeypatch.setenv("JUPYTER_VGPU_NODE", "gpu-node-2")
    app = ArbiterApp()
    assert (app.node_name, app.mps_daemons) == ("gpu-node-2", False)


def test_a_server_known_by_its_pod_owns_every_process_of_the_pod(pods):
    arbiter = new_arbiter(pods)
    ada_pid, bob_pid = list(pods)
    server = arbiter.register(0, "ada", "", SLICE, pod_uid=ADA_POD)
    assert server.root == f"pod:{ADA_POD}"
    assert arbiter.server_of(ada_pid) is server
    assert arbiter.server_of(bob_pid) is None  # bob's pod is not registered
    assert arbiter.root_of(bob_pid) is None
    # the watchdog attributes NVML's host PIDs through the same books
    owner = owners(arbiter.servers.values(), arbiter.mapping)
    # (no card of its own to be off: the device plugin, not the slice, picks the pod's)
    assert owner(ada_pid) == Owner(f"pod:{ADA_POD}", "ada/", 8 * GiB, "pod")
    assert owner(bob_pid) is None
    # a process tree registered by PID still wins for its own processes
    tree = arbiter.register(bob_pid, "bob", "", SLICE.replace(memory_limit=4 * GiB))
    assert arbiter.server_of(bob_pid) is tree
    assert owners(arbiter.servers.values(), arbiter.mapping)(bob_pid) == Owner(
        bob_pid, "bob/", 4 * GiB, "tree", (SLICE.gpu_uuid,)
    )
    assert arbiter.snapshot()["servers"][0]["pod_uid"] == ADA_POD


class Slices(tornado.web.RequestHandler):
    def initialize(self, answer, seen):
        self.answer, self.seen = answer, seen

    def get(self):
        self.seen.append(self.request.headers.get("Authorization"))
        self.write(json.dumps(self.answer))


def entry(user, pod, node, slice_=SLICE):
    return {"user": user, "server_name": "", "node": node, "pod_uid": pod, "slice": slice_.to_dict()}


@pytest.mark.asyncio
async def test_the_arbiter_takes_the_hubs_slices_of_its_own_nodes_pods(pods):
    answer = [
        entry("ada", ADA_POD, "gpu-node-1"),
        entry("bob", BOB_POD, "gpu-node-2"),  # another node's pod
        entry("cy", "7f000000-0000-4000-8000-000000000002", "gpu-node-1", SLICE.replace(gpu_uuid="pending")),
    ]
    seen: list = []
    app = tornado.web.Application([(r"/hub/api/vgpu/slices", Slices, {"answer": answer, "seen": seen})])
    server = app.listen(0, address="127.0.0.1")
    port = next(iter(server._sockets.values())).getsockname()[1]
    try:
        arbiter = new_arbiter(pods)
        link = HubLink(arbiter, f"http://127.0.0.1:{port}/hub/api", "arbiter-token", node="gpu-node-1")
        await link.refresh()
        assert seen == ["token arbiter-token"]
        assert list(arbiter.servers) == [f"pod:{ADA_POD}"]  # not bob's (node 2), not cy's (GPU pending)
        ada_pid, bob_pid = list(pods)
        assert arbiter.server_of(ada_pid).key == "ada/"
        assert arbiter.server_of(bob_pid) is None
        answer[2] = entry("cy", "7f000000-0000-4000-8000-000000000002", "gpu-node-1")
        del answer[0]  # ada's server stopped
        await link.refresh()
        assert list(arbiter.servers) == ["pod:7f000000-0000-4000-8000-000000000002"]
    finally:
        server.stop()
        await asyncio.sleep(0)


def test_the_node_report_names_the_pods_using_each_gpu_and_keeps_its_contract(pods):
    ada_pid, bob_pid = list(pods)
    devices = [
        {
            "uuid": "GPU-aaaa",
            "index": 0,
            "name": "NVIDIA H100 80GB HBM3",
            "memory": 80 * GiB,
            "used": 75 * GiB,
            "mig_profile": None,
            "compute_percent": None,
        },
        {
            "uuid": "MIG-bbbb",
            "index": 1,
            "name": "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
            "memory": 10 * GiB,
            "used": GiB,
            "mig_profile": "1g.10gb",
            "compute_percent": 14,
        },
    ]
    processes = {"GPU-aaaa": {ada_pid: 70 * GiB, 99999999: GiB}, "MIG-bbbb": {bob_pid: GiB}}
    document = report.build(
        "gpu-node-1", devices, processes, [ada_pid, ada_pid, bob_pid], watermark=0.9, pod_of=pods.get
    )
    contracts.validate("node-report", document)
    assert [g["pressure"] for g in document["gpus"]] == [True, False]
    assert document["pods"] == sorted(
        [
            {"uid": ADA_POD, "gpus": ["GPU-aaaa"], "kernels": 2},
            {"uid": BOB_POD, "gpus": ["MIG-bbbb"], "kernels": 1},
        ],
        key=lambda p: p["uid"],
    )
    with pytest.raises(contracts.ContractError, match=r"gpus\[0\].memory"):
        report.build("n", [{**devices[0], "memory": -1}], {}, [], watermark=0.9)


@pytest.mark.skipif(nvml.available(), reason="this host has an NVIDIA driver")
def test_without_nvml_the_report_says_so_and_lists_no_gpu():
    devices, processes, problems = report.read_devices()
    assert (devices, processes) == ([], {})
    assert problems[0].startswith("NVML failed on this node:")
    document = report.build("gpu-node-1", devices, processes, [], watermark=0.9, problems=problems)
    assert document["gpus"] == []
    assert document["problems"] == problems
