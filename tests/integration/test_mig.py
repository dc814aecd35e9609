"""MIG and MPS through the real demo hub: simulated GPU 1 is in MIG mode (3g.40gb, 2g.20gb
and two 1g.10gb instances) and GPU 0 is shared through MPS; slices get whole instances by
their MIG UUID, users pick a profile that fits their quota on the spawn form, nothing on
an instance is overcommitted, and MPS slices carry MPS's client limits."""

import re
from urllib.parse import urlparse

import pytest

from jupyter_vgpu.host.socket_path import mps_pipe_directory
from jupyter_vgpu.testing.hub_process import HubProcess
from jupyter_vgpu.testing.lab_client import LabClient

GiB = 2**30
PROFILES = "3g.40gb,2g.20gb,1g.10gb,1g.10gb"


@pytest.fixture(scope="module")
def hub():
    process = HubProcess("mig-hub", {"JUPYTER_VGPU_DEMO_MIG": PROFILES, "JUPYTER_VGPU_DEMO_ISOLATION": "mps"})
    try:
        process.start()
        for name in ("mia", "max", "moe", "sam"):
            process.user_token(name)
            r = process.api("PUT", f"/vgpu/quotas/users/{name}", json={"memory_limit": "16G", "priority": 60})
            assert r.status_code == 200, r.text
        yield process
    finally:
        process.shutdown()


def slice_of(hub, user):
    return next(s for s in hub.api("GET", "/vgpu/slices").json() if s["user"] == user)


def test_the_inventory_lists_the_instances(hub):
    doc = hub.api("GET", "/vgpu/quotas").json()
    assert [(p["profile"], p["total"], p["memory"]) for p in doc["mig_profiles"]] == [
        ("1g.10gb", 2, 10 * GiB),
        ("2g.20gb", 1, 20 * GiB),
        ("3g.40gb", 1, 40 * GiB),
    ]
    gpus = hub.api("GET", "/vgpu/usage").json()["gpus"]
    assert [g["label"] for g in gpus] == [
        "GPU 0",
        "GPU 1 MIG 3g.40gb",
        "GPU 1 MIG 2g.20gb",
        "GPU 1 MIG 1g.10gb",
        "GPU 1 MIG 1g.10gb",
    ]
    assert [g["isolation"] for g in gpus] == ["mps"] + ["mig"] * 4
    assert all(g["uuid"].startswith("MIG-sim-") for g in gpus[1:])
    assert all(g["capacity"] == g["memory"] for g in gpus[1:])  # no overcommit


def test_the_spawn_form_offers_the_profiles_that_fit_the_quota(hub):
    session = hub.login("mia")
    page = session.get(f"{hub.url}/hub/spawn/mia")
    assert page.status_code == 200
    assert 'value="shared"' in page.text
    assert "Shared GPU: up to 16.00 GiB, compute share 50% under MPS, not enforced" in page.text
    assert 'value="mig:1g.10gb"' in page.text
    assert (
        "MIG 1g.10gb: 10.00 GiB, 14% of the GPU&#x27;s SMs, a hardware partition (2 of 2 free)" in page.text
    )
    assert 'value="mig:2g.20gb"' not in page.text  # 20 GiB is above her 16 GiB quota
    assert "Above your quota of 16.00 GiB: 2g.20gb, 3g.40gb." in page.text


def test_a_profile_picked_on_the_form_gives_a_whole_instance(hub):
    session = hub.login("mia")
    session.get(f"{hub.url}/hub/spawn/mia")
    xsrf = session.cookies.get("_xsrf", path="/hub/")
    # The form's answer is a redirect to the spawn-pending page or, if the spawn was quick,
    # to the server; the lab page itself is not what this test is about, so stop there.
    r = session.post(
        f"{hub.url}/hub/spawn/mia",
        data={"vgpu": "mig:1g.10gb", "_xsrf": xsrf},
        allow_redirects=False,
        timeout=30,
    )
    assert r.status_code == 302, r.text[-500:]
    where = urlparse(r.headers["Location"]).path.rstrip("/")
    assert where.endswith(("/hub/spawn-pending/mia", "/user/mia")), r.headers
    hub.spawn("mia")  # waits until the server is ready through the proxy (a second start is a no-op)
    s = slice_of(hub, "mia")
    assert s["isolation"] == "mig"
    assert s["mig_profile"] == "1g.10gb"
    assert s["gpu_uuid"].startswith("MIG-sim-")
    assert (s["memory_limit"], s["memory_request"], s["compute_share"]) == (10 * GiB, 10 * GiB, 14)
    assert s["slice"]["overcommit_ratio"] == 1.0
    assert s["priority"] == 60
    assert s["compute_share_text"] == "MIG instance 1g.10gb (hardware partition)"
    lab = LabClient(f"{hub.url}/user/mia/", session=session)
    doc = lab.get("api/vgpu/usage").json()
    assert doc["slice"]["gpu_uuid"] == s["gpu_uuid"]
    assert doc["slice"]["isolation"] == "mig"


def test_the_rest_api_takes_a_profile_and_says_why_it_cannot(hub):
    events = hub.spawn_events("max", {"mig_profile": "1g.10gb"})
    assert events[-1].get("ready"), events
    placed = [e["message"] for e in events if "vGPU slice" in e.get("message", "")]
    assert re.match(r"Placed your vGPU slice on MIG instance 1g\.10gb of simulated GPU 1 \(", placed[0])
    assert "10.00 GiB, guaranteed, a hardware partition with 14% of the GPU's SMs; priority 60" in placed[0]
    assert slice_of(hub, "max")["gpu_uuid"] != slice_of(hub, "mia")["gpu_uuid"]
    # both 1g.10gb instances are taken now
    events = hub.spawn_events("moe", {"mig_profile": "1g.10gb"})
    assert events[-1].get("failed")
    assert "Every MIG instance of profile 1g.10gb is taken (2 on this hub)" in events[-1]["message"]
    events = hub.spawn_events("moe", {"mig_profile": "3g.40gb"})
    assert events[-1].get("failed")
    assert (
        "MIG profile 3g.40gb (40.00 GiB) is more than your vGPU quota of 16.00 GiB" in events[-1]["message"]
    )
    events = hub.spawn_events("moe", {"mig_profile": "../../etc"})
    assert events[-1].get("failed")
    assert "mig_profile must be a MIG profile name like '1g.10gb'" in events[-1]["message"]


def test_without_a_profile_the_slice_goes_to_a_shared_gpu_with_mps_limits(hub):
    token = hub.user_token("sam")
    url = hub.spawn("sam", options={})
    s = slice_of(hub, "sam")
    assert (s["isolation"], s["gpu_index"], s["memory_limit"]) == ("mps", 0, 16 * GiB)
    assert s["compute_share_text"] == "50% under MPS, not enforced (set in the server's environment)"
    lab = LabClient(url, token=token)
    kernel = lab.start_kernel()
    env = lab.execute(
        kernel,
        "import os; print(os.environ['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE'], "
        "os.environ['CUDA_MPS_PINNED_DEVICE_MEM_LIMIT'], os.environ['CUDA_MPS_PIPE_DIRECTORY'])",
    )
    # the arbiter's daemon for that GPU
    pipe = mps_pipe_directory(str(hub.state_dir / "arbiter" / "arbiter.sock"), s["gpu_uuid"])
    assert env.split() == ["50", "0=16384M", str(pipe)]
    lab.shutdown_kernel(kernel)


def test_a_quota_change_keeps_the_instance_and_follows_the_priority(hub):
    r = hub.api("PATCH", "/vgpu/quotas/users/mia", json={"memory_limit": "2G", "priority": 90})
    assert r.status_code == 200, r.text
    s = slice_of(hub, "mia")
    assert (s["memory_limit"], s["priority"], s["mig_profile"]) == (10 * GiB, 90, "1g.10gb")


def test_the_admin_page_shows_the_instances(hub):
    page = hub.login("admin").get(f"{hub.url}/hub/vgpu")
    assert "GPU 1 MIG 1g.10gb" in page.text
    assert 'data-isolation="mig"' in page.text
    assert "MIG instance 1g.10gb (hardware partition)" in page.text
