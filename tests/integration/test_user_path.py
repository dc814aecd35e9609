"""The whole path, real at every step: login form, spawn, slice, kernel, live quota, restart."""

import pytest

from jupyter_vgpu import contracts
from jupyter_vgpu.testing.lab_client import LabClient
from jupyter_vgpu.testing.waiting import wait_for

GiB = 2**30


@pytest.fixture(scope="module")
def ada(hub):
    """Ada logs in through the login form, her server is spawned with a 6 GiB quota, and
    she reaches it as a browser does: the Hub's OAuth, then the server's cookie."""
    session = hub.login("ada")
    assert session.cookies.get("jupyterhub-hub-login") or session.cookies.get("jupyterhub-session-id")
    home = session.get(f"{hub.url}/hub/home")
    assert home.status_code == 200
    assert "ada" in home.text
    r = hub.api("PUT", "/vgpu/quotas/users/ada", json={"memory_limit": "6G", "compute_share": 40})
    assert r.status_code == 200, r.text
    events = hub.spawn_events("ada")
    assert events[-1].get("ready"), events
    lab = LabClient(f"{hub.url}/user/ada/", session=session)
    kernel = lab.start_kernel()
    yield lab, kernel, events
    lab.shutdown_kernel(kernel)


def wait_for_status(lab, kernel, text, timeout):
    """``%vgpu status`` once it shows ``text``."""
    return wait_for(
        lambda: (out := lab.execute(kernel, "%vgpu status")) and text in out and out,
        timeout,
        f"{text!r} in the kernel's %vgpu status",
        interval=0.25,
    )


def test_the_slice_follows_the_quota(hub, ada):
    slices = hub.api("GET", "/vgpu/slices").json()
    mine = next(s for s in slices if s["user"] == "ada")
    assert mine["memory_limit"] == 6 * GiB
    assert mine["memory_request"] == 6 * GiB
    assert mine["compute_share"] == 40
    assert mine["compute_share_text"] == "not enforced (time-sliced)"
    assert mine["priority"] == 50
    assert mine["isolation"] == "time-slicing"
    assert mine["simulated"] is True
    assert mine["gpu_uuid"].startswith("GPU-sim-")
    contracts.validate("slice", mine["slice"])


def test_the_spawn_page_said_where_the_slice_went(ada):
    _, _, events = ada
    placed = [e["message"] for e in events if "vGPU slice" in e.get("message", "")]
    assert placed == [
        "Placed your vGPU slice on simulated GPU 0 (NVIDIA H100 80GB HBM3 (simulated)): 6.00 GiB budget, "
        "all of it guaranteed; compute share not enforced (time-sliced); priority 50"
    ]


def test_the_server_extension_reports_the_slice_through_the_proxy(ada):
    lab, _, _ = ada
    doc = lab.get("api/vgpu/usage").json()
    contracts.validate("usage", doc)
    assert doc["slice"]["memory_limit"] == 6 * GiB
    assert doc["slice"]["compute_share"] == 40
    assert doc["simulated"] is True


def test_vgpu_status_in_the_kernel(ada):
    lab, kernel, _ = ada
    out = lab.execute(kernel, "%vgpu status")
    assert "6.00 GiB" in out
    assert "40%" in out
    assert "simulated" in out
    assert "binpack, overcommit ratio 1.5" in out
    env = lab.execute(kernel, "from jupyter_vgpu.slice import Slice; print(Slice.from_env().memory_limit)")
    assert env.strip() == str(6 * GiB), env


def test_the_kernels_channels_are_unix_sockets_only_its_user_can_reach(ada):
    # over TCP any account of the host could subscribe to the kernel's IOPub port and read
    # its outputs (VGPUHub.kernel_transport; jupyter_vgpu.server.kernel_sockets)
    lab, kernel, _ = ada
    out = lab.execute(
        kernel,
        "import json, os, stat\n"
        "from ipykernel.connect import get_connection_info\n"
        "info = json.loads(get_connection_info())\n"
        "where = os.stat(os.path.dirname(info['ip']))\n"
        "print(info['transport'], oct(stat.S_IMODE(where.st_mode)), where.st_uid == os.getuid())",
    )
    assert out.split() == ["ipc", "0o700", "True"], out


def test_a_quota_change_reaches_the_running_kernel_within_5_seconds(hub, ada):
    lab, kernel, _ = ada
    r = hub.api("PUT", "/vgpu/quotas/users/ada", json={"memory_limit": "3G", "compute_share": 20})
    assert r.status_code == 200, r.text
    out = wait_for_status(lab, kernel, "3.00 GiB", timeout=5)
    assert "20%" in out
    mine = hub.api("GET", "/vgpu/slices/users/ada", token=hub.user_token("ada")).json()
    assert [s["memory_limit"] for s in mine] == [3 * GiB]


def test_a_spawn_that_does_not_fit_fails_with_a_readable_message(hub, ada):
    # ada holds 3 GiB on GPU 0; a 118 GiB limit (40 GiB guaranteed) fits only on the
    # empty GPU 1 (120 GiB of limits with overcommit 1.5), and the next one nowhere.
    for name in ("bob", "carol"):
        hub.user_token(name)
        quota = {"memory_limit": "118G", "memory_request": "40G"}
        assert hub.api("PUT", f"/vgpu/quotas/users/{name}", json=quota).status_code == 200
    hub.spawn("bob")
    try:
        events = hub.spawn_events("carol")
        assert events[-1].get("failed"), events
        message = events[-1]["message"]
        assert "No GPU has room for a 118.00 GiB vGPU slice (40.00 GiB guaranteed)" in message
        assert "GPU 0" in message
        assert "GPU 1" in message
        page = hub.login("carol").get(f"{hub.url}/hub/spawn-pending/carol")
        assert "No GPU has room" in page.text
        assert "Traceback" not in page.text
    finally:
        hub.stop_server("bob")


def test_a_guarantee_larger_than_any_card_is_explained(hub, ada):
    hub.user_token("dora")
    assert hub.api("PUT", "/vgpu/quotas/users/dora", json={"memory_limit": "100G"}).status_code == 200
    events = hub.spawn_events("dora")
    assert events[-1].get("failed"), events
    assert "guarantee of 100.00 GiB is more than any GPU's memory (80.00 GiB)" in events[-1]["message"]


def test_quotas_and_slices_survive_a_hub_restart(hub, ada):
    lab, kernel, _ = ada
    before_quotas = hub.api("GET", "/vgpu/quotas").json()
    before = [s for s in hub.api("GET", "/vgpu/slices").json() if s["user"] == "ada"]
    hub.restart()
    assert hub.api("GET", "/vgpu/quotas").json() == before_quotas
    after = [s for s in hub.api("GET", "/vgpu/slices").json() if s["user"] == "ada"]
    assert [s["slice"] for s in after] == [s["slice"] for s in before]
    status = lab.execute(kernel, "%vgpu status")
    assert "3.00 GiB" in status, status
    # the restored placement still counts: a change is still checked and applied live
    assert hub.api("PATCH", "/vgpu/quotas/users/ada", json={"memory_limit": "5G"}).status_code == 200
    wait_for_status(lab, kernel, "5.00 GiB", timeout=5)
