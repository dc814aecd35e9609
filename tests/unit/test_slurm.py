"""Slurm without a cluster: what the Hub reads from ``scontrol`` (node and job lines as
Slurm 22.05 prints them), the GPUs and shards it derives, and the node arbiter's servers
known by their Slurm job (the job of a process comes from its cgroup; here a stand-in
says which real processes are in which job, tests/integration/test_slurm.py reads real
ones)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import tornado.web

from hub_spawner import slurm_nodes, slurm_profiles
from hub_spawner.inventory import GPU
from hub_spawner.placement import Allocator, PlacementError
from jupyter_vgpu.node import slurm
from jupyter_vgpu.node.app import ArbiterApp, HubLink
from jupyter_vgpu.node.arbiter import Arbiter
from jupyter_vgpu.node.report import NodeReporter
from jupyter_vgpu.slice import Slice

GiB = 2**30
SLICE = Slice("GPU-sim-vgpu-n1-0", 0, "Simulated GPU", 16 * GiB, 4 * GiB, 50, simulated=True)

NODES = (
    "NodeName=vgpu-n1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=16 CPUTot=16 Gres=gpu:2,shard:16 "
    "NodeAddr=10.213.0.11 NodeHostName=vgpu-n1 Version=22.05.8 State=IDLE Partitions=gpu \n"
    "NodeName=vgpu-n2 Arch=x86_64 Gres=gpu:a100:4(S:0-1),shard:a100:32 NodeAddr=10.213.0.12 "
    "State=MIXED Partitions=gpu,debug \n"
    "NodeName=cpu-1 Gres=(null) NodeAddr=cpu-1 State=IDLE Partitions=cpu \n"
    "NodeName=vgpu-n3 Gres=gpu:1,shard:8 NodeAddr=10.213.0.13 State=DOWN+DRAIN Partitions=gpu \n"
)
RUNNING = (
    "JobId=12 JobName=spawner-jupyterhub UserId=root(0) JobState=RUNNING Reason=None Partition=gpu "
    "ReqNodeList=vgpu-n1 NodeList=vgpu-n1 BatchHost=vgpu-n1 NumNodes=1 JOB_GRES=shard:3 "
    "Nodes=vgpu-n1 CPU_IDs=0 Mem=0 GRES=shard:3(IDX:1) TresPerNode=gres:shard:3"
)
PENDING = (
    "JobId=13 JobName=spawner-jupyterhub JobState=PENDING Reason=ReqNodeNotAvail,_UnavailableNodes:vgpu-n1 "
    "Partition=gpu ReqNodeList=vgpu-n1 NodeList= TresPerNode=gres:shard:2"
)


def test_nodes_and_their_gres_as_scontrol_lists_them():
    nodes = slurm_nodes.parse_nodes(NODES)
    assert [(n.name, n.address, n.gpus, n.shards, n.shards_per_gpu) for n in nodes] == [
        ("vgpu-n1", "10.213.0.11", 2, 16, 8),
        ("vgpu-n2", "10.213.0.12", 4, 32, 8),
        ("cpu-1", "cpu-1", 0, 0, 0),
        ("vgpu-n3", "10.213.0.13", 1, 8, 8),
    ]
    assert nodes[1].partitions == ("gpu", "debug")
    assert [n.usable for n in nodes] == [True, True, True, False]
    assert slurm_nodes.gres_counts("gpu:tesla:1(S:0),gpu:a100:2,mps:100") == {"gpu": 3, "mps": 100}


def test_where_a_job_landed_and_why_one_waits():
    place = slurm_nodes.parse_job(RUNNING)
    assert (place.state, place.reason, place.node, place.gpu_indices) == ("RUNNING", "None", "vgpu-n1", (1,))
    whole = slurm_nodes.parse_job("JobState=RUNNING Nodes=n7 CPU_IDs=0-3 Mem=0 GRES=gpu:2(IDX:0,2-3)")
    assert (whole.node, whole.gpu_indices) == ("n7", (0, 2, 3))
    waiting = slurm_nodes.parse_job(PENDING)
    assert (waiting.state, waiting.node, waiting.gpu_indices) == ("PENDING", "", ())
    assert waiting.reason == "ReqNodeNotAvail, UnavailableNodes:vgpu-n1"


def test_the_gpus_come_from_reports_placeholders_or_simulation():
    nodes = slurm_nodes.parse_nodes(NODES)
    reported = [GPU(0, "GPU-1111", "NVIDIA H100 80GB HBM3", 80 * GiB, False, node="vgpu-n1"),
                GPU(1, "GPU-2222", "NVIDIA H100 80GB HBM3", 80 * GiB, False, node="vgpu-n1")]  # fmt: skip
    found, problems = slurm_nodes.devices(nodes, {"vgpu-n1": reported})
    assert [d.uuid for d in found] == ["GPU-1111", "GPU-2222"]  # vgpu-n2 has not reported
    assert any("vgpu-n2: GPU 0 is not known yet" in p for p in problems)
    assert any("vgpu-n3 is DOWN+DRAIN" in p for p in problems)
    found, _ = slurm_nodes.devices(nodes, {"vgpu-n1": reported}, gpu_memory=40 * GiB)
    assert [(d.uuid, d.node, d.memory) for d in found[2:]] == [
        (f"vgpu-n2/gpu-{i}", "vgpu-n2", 40 * GiB) for i in range(4)
    ]
    found, _ = slurm_nodes.devices(
        nodes, {"vgpu-n1": reported}, simulate=True, simulated_memory=16 * GiB, simulated_name="sim"
    )
    assert [d.uuid for d in found] == [
        "GPU-sim-vgpu-n1-0", "GPU-sim-vgpu-n1-1", *(f"GPU-sim-vgpu-n2-{i}" for i in range(4)),
    ]  # fmt: skip
    assert all(d.simulated and d.memory == 16 * GiB and d.label.startswith(d.node) for d in found)


def test_shards_stand_for_guaranteed_memory():
    # an 80 GiB GPU cut into 80 shards: one per GiB
    assert slurm_nodes.shards_for(4 * GiB, 80 * GiB, 80) == 4
    assert slurm_nodes.shards_for(4 * GiB + 1, 80 * GiB, 80) == 5  # rounded up
    assert slurm_nodes.shards_for(1, 80 * GiB, 80) == 1
    assert slurm_nodes.shards_for(100 * GiB, 80 * GiB, 80) == 80
    assert slurm_nodes.shard_bytes(2, 16 * GiB, 16) == 2 * GiB
    with pytest.raises(ValueError, match="Name=shard"):
        slurm_nodes.shards_for(GiB, 80 * GiB, 0)


def test_placement_keeps_to_the_jobs_partition():
    gpus = [
        GPU(0, "GPU-a", "H100", 80 * GiB, False, node="n1"),
        GPU(0, "GPU-b", "H100", 80 * GiB, False, node="n2"),
    ]
    a = Allocator(gpus, 1.0)
    assert a.place("ada/", 8 * GiB, 50, only=lambda g: g.node == "n2").uuid == "GPU-b"
    with pytest.raises(PlacementError) as e:
        a.place("bob/", 78 * GiB, 50, only=lambda g: g.node == "n2")
    assert "n2 GPU 0 (H100) has 72.00 GiB left" in str(e.value)
    assert "n1 GPU 0" not in str(e.value)


@pytest.mark.parametrize(
    ("cgroup", "job"),
    [
        ("6:freezer:/slurm/uid_1000/job_42/step_batch\n5:devices:/\n0::/\n", "42"),
        ("6:freezer:/slurm_vgpu-n2/uid_0/job_7/step_0\n", "7"),  # one slurmd per node on a host
        ("0::/system.slice/slurmstepd.scope/job_1234/step_0/user/task_0\n", "1234"),
        ("0::/system.slice/slurmstepd.scope/job_12\n", "12"),
        ("0::/user.slice/user-1000.slice/session-3.scope\n", None),
        ("4:memory:/kubepods/burstable/pod0b7e5c1e-1f4c-4c55-9d2e-2f6f3a0f1a11/abc\n", None),
        ("0::/job_42x/\n", None),
    ],
)
def test_the_job_of_a_cgroup(cgroup, job):
    assert slurm.parse_job_id(cgroup) == job


def test_a_process_outside_slurm_has_no_job():
    assert slurm.job_id(os.getpid()) is None  # the tests run in no job
    assert slurm.job_key(os.getpid()) is None
    assert slurm.job_id(2**22 + 12345) is None  # no such process


@pytest.fixture
def jobs():
    """Two real processes, in jobs 41 and 42 as the stand-in for their cgroups says."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    yield {procs[0].pid: "41", procs[1].pid: "42"}
    for p in procs:
        p.kill()
        p.wait()


def test_a_server_known_by_its_job_owns_every_process_of_the_job(jobs):
    arbiter = Arbiter(
        ArbiterApp(registrars="none", over_budget="report"), pod_of=lambda pid: None, job_of=jobs.get
    )
    ada_pid, bob_pid = list(jobs)
    server = arbiter.register(0, "ada", "", SLICE, job_id="41")
    assert server.root == "job:41"
    assert arbiter.server_of(ada_pid) is server
    assert arbiter.server_of(bob_pid) is None  # job 42 is not registered
    assert arbiter.snapshot()["servers"][0]["job_id"] == "41"
    reporter = NodeReporter(arbiter, "vgpu-n1", "http://127.0.0.1:1/hub/api", "t", 0.9)
    assert reporter.owner(ada_pid) == "job:41"  # how the node report files its processes
    assert reporter.owner(os.getpid()) is None


class Slices(tornado.web.RequestHandler):
    def initialize(self, answer):
        self.answer = answer

    def get(self):
        self.write(json.dumps(self.answer))


@pytest.mark.asyncio
async def test_the_arbiter_takes_the_hubs_slices_of_its_own_nodes_jobs(jobs):
    def entry(user, job, node):
        return {
            "user": user,
            "server_name": "",
            "node": node,
            "job_id": job,
            "pid": None,
            "slice": SLICE.to_dict(),
        }

    answer = [entry("ada", "41", "vgpu-n1"), entry("bob", "42", "vgpu-n2")]
    app = tornado.web.Application([(r"/hub/api/vgpu/slices", Slices, {"answer": answer})])
    server = app.listen(0, address="127.0.0.1")
    port = next(iter(server._sockets.values())).getsockname()[1]
    try:
        arbiter = Arbiter(ArbiterApp(registrars="none", over_budget="report"), job_of=jobs.get)
        link = HubLink(arbiter, f"http://127.0.0.1:{port}/hub/api", "token", node="vgpu-n1")
        await link.refresh()
        assert list(arbiter.servers) == ["job:41"]  # not bob's job on vgpu-n2
        ada_pid, bob_pid = list(jobs)
        assert arbiter.server_of(ada_pid).key == "ada/"
        assert arbiter.server_of(bob_pid) is None
        answer.clear()  # ada's server stopped
        await link.refresh()
        assert arbiter.servers == {}
    finally:
        server.stop()
        await asyncio.sleep(0)


def test_profiles_in_kubespawners_shape():
    profiles = [
        {"display_name": "Small GPU", "spawner_override": {"vgpu_memory_limit": "4G"}},
        {"display_name": "<Whole> GPU", "slug": "whole", "default": True, "description": "<em>8 h</em>"},
    ]
    assert [p["slug"] for p in slurm_profiles.normalized(profiles)] == ["small-gpu", "whole"]
    assert slurm_profiles.chosen(profiles, {})["slug"] == "whole"  # the default one
    assert slurm_profiles.chosen(profiles, {"profile": "small-gpu"})["display_name"] == "Small GPU"
    assert slurm_profiles.chosen([], {"profile": "x"}) is None
    with pytest.raises(ValueError, match="No profile 'huge'; the profiles: small-gpu, whole"):
        slurm_profiles.chosen(profiles, {"profile": "huge"})
    form = slurm_profiles.render(profiles, {"small-gpu": "vGPU: 4.00 GiB <budget>"}, "whole")
    assert 'value="whole" checked>' in form
    assert 'value="small-gpu">' in form
    assert "&lt;Whole&gt; GPU" in form  # names are escaped; descriptions are the admin's HTML
    assert "<em>8 h</em>" in form
    assert "vGPU: 4.00 GiB &lt;budget&gt;" in form
