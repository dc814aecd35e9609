"""JupyterHub on a real Slurm cluster (slurmctld, munge, two slurmd nodes in network
namespaces, simulated GPUs as GRES, a node arbiter per node): a user's server is a real
sbatch job, submitted as her own account, on the node the Hub placed its slice on,
holding the GPU shards its guarantee needs; its kernel follows a quota change live; both
nodes report to the Hub, which says they are simulated and how users are kept apart on
them; Slurm's refusals reach the spawn page in its own words; stopping the server ends
the job."""

from __future__ import annotations

import json
import os
import pwd
import re

import psutil
import pytest

from jupyter_vgpu.host.arbiter_control import Control
from jupyter_vgpu.testing.lab_client import LabClient
from jupyter_vgpu.testing.slurm_cluster import SlurmCluster, hub_api_url, slurm_hub, why_not
from jupyter_vgpu.testing.waiting import wait_for

pytestmark = pytest.mark.slurm

GiB = 2**30
PROFILES = [
    {
        "display_name": "Small",
        "slug": "small",
        "default": True,
        "spawner_override": {"vgpu_memory_limit": "2G"},
    },
    {"display_name": "Large", "slug": "large", "spawner_override": {"vgpu_memory_limit": "12G"}},
    {"display_name": "Nowhere", "slug": "nowhere", "spawner_override": {"req_partition": "nowhere"}},
    {"display_name": "Much memory", "slug": "much-memory", "spawner_override": {"req_memory": "900G"}},
    {"display_name": "Whole GPU", "slug": "whole", "spawner_override": {"vgpu_gres": "gpu"}},
    {
        "display_name": "Two GPUs",
        "slug": "pair",
        "spawner_override": {"vgpu_gres": "gpu", "vgpu_gpu_count": 2},
    },
]


@pytest.fixture(scope="module")
def cluster():
    reason = why_not()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Slurm tests, but the cluster cannot start here: {reason}")
        pytest.skip(f"no Slurm test cluster on this machine: {reason}")
    c = SlurmCluster(nodes=2, gpus=2, shards=16)
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def hub(cluster):
    process = slurm_hub(
        cluster,
        "slurm-hub",
        {"JUPYTER_VGPU_DEMO_SLURM_PENDING": "4", "JUPYTER_VGPU_DEMO_SLURM_PROFILES": json.dumps(PROFILES)},
    )
    try:
        process.start()
        cluster.start_arbiters(
            hub_api_url(cluster, process), "--ArbiterApp.report_seconds=1", "--ArbiterApp.hub_poll_seconds=1"
        )
        yield process
    finally:
        process.shutdown()


def mine(hub, user: str) -> dict:
    return next(s for s in hub.api("GET", "/vgpu/slices").json() if s["user"] == user)


@pytest.fixture(scope="module")
def ada(hub, cluster):
    """Ada logs in through the login form; on the spawn form the 12 GiB profile is refused
    (above her 6 GiB quota) and the small one (a 2 GiB budget, all of it guaranteed) runs
    as a Slurm job."""
    session = hub.login("ada")
    assert hub.api("PUT", "/vgpu/quotas/users/ada", json={"memory_limit": "6G"}).status_code == 200
    form = session.get(f"{hub.url}/hub/spawn")
    assert form.status_code == 200
    assert 'value="small"' in form.text
    assert "vGPU: 2.00 GiB budget, all of it guaranteed" in form.text
    assert "Above your vGPU quota" in form.text  # the 12 GiB profile
    xsrf = session.cookies.get("_xsrf", path="/hub/")
    refused = session.post(f"{hub.url}/hub/spawn", data={"profile": "large", "_xsrf": xsrf}, timeout=30)
    assert "The profile &#39;large&#39; asks for a vGPU budget of 12.00 GiB" in refused.text
    assert "more than your quota&#39;s 6.00 GiB" in refused.text
    chosen = session.post(f"{hub.url}/hub/spawn", data={"profile": "small", "_xsrf": xsrf}, timeout=30)
    assert chosen.status_code == 200, chosen.text[:500]
    events = hub.progress("ada")
    assert events[-1].get("ready"), events
    hub.spawn("ada")  # ready through the proxy too
    lab = LabClient(f"{hub.url}/user/ada/", session=session)
    kernel = lab.start_kernel()
    yield lab, kernel, events
    lab.shutdown_kernel(kernel)


def test_the_server_is_a_slurm_job_on_the_node_the_hub_named(hub, cluster, ada):
    _, _, events = ada
    slice_ = mine(hub, "ada")
    node, job = slice_["node"], slice_["job_id"]
    assert node in cluster.info["nodes"]
    assert slice_["slurm_gres"] == "shard:2"  # 2 GiB guaranteed, 1 GiB shards
    messages = [e["message"] for e in events]
    assert any(m.startswith(f"Placed your vGPU slice on Slurm node {node}, simulated GPU") for m in messages)
    assert f"Submitted Slurm job {job} to node {node} (--gres=shard:2)" in messages
    fields = cluster.job(job)
    assert fields["JobState"] == "RUNNING"
    # submitted as her own account, as a real site's Hub submits its users' jobs
    account = pwd.getpwnam(hub.account_name("ada"))
    assert fields["UserId"] == f"{account.pw_name}({account.pw_uid})"
    assert slice_["account"] == account.pw_name
    assert fields["ReqNodeList"] == node
    assert fields["NodeList"] == node
    # the GPU Slurm gave the shards on is the one the slice records
    detail = re.search(r"GRES=shard:2\(IDX:(\d+)\)", cluster.run("scontrol", "show", "job", "-d", job))
    assert detail, cluster.run("scontrol", "show", "job", "-d", job)
    assert slice_["gpu_index"] == int(detail[1])
    assert slice_["gpu_uuid"] == f"GPU-sim-{node}-{detail[1]}"


def test_the_node_arbiter_knows_the_job_by_its_cgroup(hub, cluster, ada):
    lab, kernel, _ = ada
    slice_ = mine(hub, "ada")
    pid = int(lab.execute(kernel, "import os; print(os.getpid())").strip())
    assert psutil.Process(pid).username() == hub.account_name("ada")  # her kernel too
    with open(f"/proc/{pid}/cgroup") as f:
        cgroup = f.read()
    assert f"/job_{slice_['job_id']}/" in cgroup, cgroup

    def joined():
        with Control(cluster.arbiter_socket(slice_["node"])) as c:
            books = c.books()
        servers = {s["key"]: s for s in books["servers"]}
        kernels = [k for k in books["kernels"] if k["pid"] == pid]
        return servers.get("ada/", {}).get("job_id") == slice_["job_id"] and kernels and kernels[0]

    kernel_entry = wait_for(joined, 30, "the node arbiter to know ada's kernel by her job", interval=0.5)
    assert kernel_entry["server"] == "ada/"
    other = next(n for n in cluster.info["nodes"] if n != slice_["node"])
    with Control(cluster.arbiter_socket(other)) as c:
        assert [s for s in c.books()["servers"] if s["user"] == "ada"] == []


def test_vgpu_status_and_a_live_quota_change(hub, ada):
    lab, kernel, _ = ada
    out = lab.execute(kernel, "%vgpu status")
    assert "2.00 GiB" in out, out
    assert "simulated" in out
    # the profile's 2 GiB budget stays below the quota; the quota's priority follows live
    r = hub.api("PUT", "/vgpu/quotas/users/ada", json={"memory_limit": "1G", "priority": 70})
    assert r.status_code == 200, r.text
    out = wait_for(
        lambda: (text := lab.execute(kernel, "%vgpu status")) and "1.00 GiB" in text and text,
        15,
        "the 1 GiB budget in ada's %vgpu status",
        interval=0.5,
    )
    assert "70" in out
    slice_ = mine(hub, "ada")
    assert slice_["memory_limit"] == 1 * GiB
    assert slice_["memory_request"] == 1 * GiB  # at most the budget; the job keeps its 2 shards


def test_a_servers_token_may_say_its_port_and_nothing_else(hub, ada):
    lab, kernel, _ = ada
    token = hub.server_token(lab, kernel)  # the user can read it in her server
    before = mine(hub, "ada")
    for body in ({"exec_prefix": "touch /tmp/vgpu-slurm-pwned;"}, {"port": 8888, "req_partition": "x"}):
        r = hub.api("POST", "/batchspawner", token=token, json=body)
        assert r.status_code == 400, r.text
        assert "nothing else" in r.json()["message"]
    r = hub.api("POST", "/batchspawner", token=token, json={"port": 8888})
    assert r.status_code == 409, r.text  # the running server's port is known
    assert hub.api("POST", "/batchspawner", json={"port": 8888}).status_code == 403  # not a server's token
    assert mine(hub, "ada") == before
    assert "1.00 GiB" in lab.execute(kernel, "%vgpu status")  # the server still answers


def test_both_nodes_are_on_the_hub_page(hub, cluster, ada):
    def reported():
        nodes = hub.api("GET", "/vgpu/nodes").json()["nodes"]
        return set(nodes) == set(cluster.info["nodes"]) and nodes

    nodes = wait_for(reported, 30, "both nodes' arbiters to report")
    assert all(n["source"] == "arbiter" and not n["stale"] for n in nodes.values())
    page = hub.login("admin").get(f"{hub.url}/hub/vgpu")
    assert page.status_code == 200
    for node in cluster.info["nodes"]:
        assert f'data-node="{node}" data-simulated="yes"' in page.text
        assert f"{node} GPU 0" in page.text  # its simulated GPUs, from Slurm's GRES
    # each node says what it is: simulated cards of 16 GiB, NVML's failure expected there
    assert page.text.count("2 simulated GPUs of 16.00 GiB") == 2
    assert "(expected: this node&#39;s GPUs are simulated)" in page.text
    assert "ada" in page.text
    assert "The node arbiters run on the nodes" in page.text
    # how users are kept apart, where their servers run
    assert "Isolation on the Slurm nodes" in page.text
    assert "each server is a Slurm job, its processes in the job&#39;s cgroup on its node" in page.text
    assert f"ada as <code>{hub.account_name('ada')}</code>" in page.text
    assert "run as root" not in page.text


def test_sbatch_refusing_the_job_reaches_the_spawn_page(hub, cluster, ada):
    hub.user_token("bob")
    events = hub.spawn_events("bob", options={"profile": "much-memory"})
    assert events[-1].get("failed"), events
    message = events[-1]["message"]
    assert "Slurm refused your server's job: Memory specification can not be satisfied" in message
    assert "Requested node configuration is not available" in message
    page = hub.login("bob").get(f"{hub.url}/hub/spawn-pending/bob")
    assert "Requested node configuration is not available" in page.text
    assert "Traceback" not in page.text
    assert all(s["user"] != "bob" for s in hub.api("GET", "/vgpu/slices").json())


def test_spawn_options_cannot_rewrite_the_job(hub, cluster, ada):
    # batchspawner renders user options into the batch script: only a profile passes
    options = {"profile": "small", "options": "--gres=shard:16", "cmd": "sleep"}
    events = hub.spawn_events("bob", options=options)
    assert events[-1].get("failed"), events
    assert "Unknown spawn option(s) 'cmd', 'options'" in events[-1]["message"]
    assert cluster.run("squeue", "-h", "-o", "%i").strip().splitlines() == [mine(hub, "ada")["job_id"]]


def test_a_partition_without_gpu_nodes_is_named(hub, ada):
    events = hub.spawn_events("bob", options={"profile": "nowhere"})
    assert events[-1].get("failed"), events
    assert "Slurm has no GPU node in partition 'nowhere' (partitions with GPUs: gpu)" in events[-1]["message"]


def test_no_shards_left_reaches_the_spawn_page_with_slurms_reason(hub, cluster, ada):
    # batch jobs outside the Hub take every free shard of every GPU
    taken = []
    ada_node = mine(hub, "ada")["node"]
    for node in cluster.info["nodes"]:
        # each fits one GPU only: Slurm puts the 14 beside ada's 2 shards
        for shards in (16, 14) if node == ada_node else (16, 16):
            job = cluster.run(
                "sbatch", "--parsable", "-o", "/dev/null", f"--nodelist={node}", f"--gres=shard:{shards}",
                "--wrap", "sleep 300",
            ).strip()  # fmt: skip
            taken.append((node, job))
    try:
        running = lambda: all(cluster.job(j)["JobState"] == "RUNNING" for _, j in taken)  # noqa: E731
        wait_for(running, 30, "the batch jobs to run")
        hub.user_token("carol")
        assert hub.api("PUT", "/vgpu/quotas/users/carol", json={"memory_limit": "2G"}).status_code == 200
        events = hub.spawn_events("carol", options={"profile": "small"})
        assert events[-1].get("failed"), events
        message = events[-1]["message"]
        kept = r"Slurm kept your server's job \d+ pending for \d+ s on node vgpu-n\d \(Resources\)"
        assert re.search(kept, message), message
        assert "(--gres=shard:2) are taken there" in message
        assert any("is pending: Resources" in e["message"] for e in events)
        # given up once the hub's vgpu_pending_timeout (4 s here) had passed, not before
        assert int(re.search(r"pending for (\d+) s", message)[1]) >= 4, message
        job = re.search(r"job (\d+) pending", message)[1]
        assert cluster.job(job)["JobState"] in ("CANCELLED", "COMPLETING", "")
        page = hub.login("carol").get(f"{hub.url}/hub/spawn-pending/carol")
        assert "(Resources)" in page.text
    finally:
        cluster.run("scancel", *(j for _, j in taken), check=False)
        ids = ",".join(j for _, j in taken)
        ended = lambda: cluster.run("squeue", "-h", "-j", ids, check=False).strip() == ""  # noqa: E731
        wait_for(ended, 30, "the batch jobs to end")


def test_a_whole_gpu_is_every_shard_of_one_gpu(hub, cluster, ada):
    hub.user_token("dora")
    assert hub.api("PUT", "/vgpu/quotas/users/dora", json={"memory_limit": "16G"}).status_code == 200
    events = hub.spawn_events("dora", options={"profile": "whole"}, timeout=120)
    assert events[-1].get("ready"), events
    try:
        dora, ada_slice = mine(hub, "dora"), mine(hub, "ada")
        assert dora["slurm_gres"] == "shard:16"
        assert (dora["memory_limit"], dora["memory_request"]) == (16 * GiB, 16 * GiB)
        # Slurm gave it a GPU no shard job holds: not ada's
        assert (dora["node"], dora["gpu_index"]) != (ada_slice["node"], ada_slice["gpu_index"])
        detail = cluster.run("scontrol", "show", "job", "-d", dora["job_id"])
        assert f"GRES=shard:16(IDX:{dora['gpu_index']})" in detail, detail
    finally:
        hub.stop_server("dora", timeout=60)


def test_a_slice_of_two_cards_is_a_job_of_two_whole_gpus_of_one_node(hub, cluster, ada):
    hub.user_token("erin")
    quota = {"memory_limit": "16G", "gpu_count": 2}
    assert hub.api("PUT", "/vgpu/quotas/users/erin", json=quota).status_code == 200
    events = hub.spawn_events("erin", options={"profile": "pair"}, timeout=120)
    assert events[-1].get("ready"), events
    try:
        erin, ada_slice = mine(hub, "erin"), mine(hub, "ada")
        assert erin["slurm_gres"] == "gpu:2"
        assert erin["gpu_indices"] == [0, 1], erin
        assert erin["node"] != ada_slice["node"]  # both cards free: the node without ada's shards
        assert (erin["memory_limit"], erin["memory_request"]) == (16 * GiB, 16 * GiB)
        detail = cluster.run("scontrol", "show", "job", "-d", erin["job_id"])
        assert "GRES=gpu:2(IDX:0-1)" in detail, detail
    finally:
        hub.stop_server("erin", timeout=60)


def test_the_job_and_its_slice_survive_a_hub_restart(hub, ada):
    lab, kernel, _ = ada
    before = mine(hub, "ada")
    hub.restart()
    after = mine(hub, "ada")
    assert {k: after[k] for k in ("node", "job_id", "slurm_gres", "slice")} == {
        k: before[k] for k in ("node", "job_id", "slurm_gres", "slice")
    }
    # the restored placement still counts: a change is checked and applied live
    r = hub.api("PUT", "/vgpu/quotas/users/ada", json={"memory_limit": "1536M", "priority": 70})
    assert r.status_code == 200, r.text
    shown = lambda: "1.50 GiB" in lab.execute(kernel, "%vgpu status")  # noqa: E731
    wait_for(shown, 15, "1.50 GiB in ada's %vgpu status", interval=0.5)


def test_stopping_the_server_ends_the_job(hub, cluster, ada):
    job = mine(hub, "ada")["job_id"]
    hub.stop_server("ada", timeout=60)
    gone = lambda: cluster.run("squeue", "-h", "-j", job, check=False).strip() == ""  # noqa: E731
    wait_for(gone, 30, f"job {job} to end")
    assert all(s["user"] != "ada" for s in hub.api("GET", "/vgpu/slices").json())
