"""The whole path, real at every step: login form, spawn, slice, kernel, live quota, restart."""

import time

import pytest

from .lab_client import LabClient

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
    url = hub.spawn("ada")
    lab = LabClient(url, session=session)
    kernel = lab.start_kernel()
    yield lab, kernel
    lab.shutdown_kernel(kernel)


def wait_for_status(lab, kernel, text, timeout):
    start = time.monotonic()
    while True:
        out = lab.execute(kernel, "%vgpu status")
        if text in out:
            return out, time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{text!r} not in %vgpu status within {timeout} s:\n{out}")
        time.sleep(0.25)


def test_the_slice_follows_the_quota(hub, ada):
    slices = hub.api("GET", "/vgpu/slices").json()
    mine = next(s for s in slices if s["user"] == "ada")
    assert mine["memory_limit"] == 6 * GiB
    assert mine["compute_share"] == 40
    assert mine["simulated"] is True
    assert mine["gpu_uuid"].startswith("GPU-sim-")


def test_the_server_extension_reports_the_slice_through_the_proxy(ada):
    lab, _ = ada
    doc = lab.get("api/vgpu/status").json()
    assert doc["slice"]["memory_limit"] == 6 * GiB
    assert doc["slice"]["compute_share"] == 40
    assert doc["simulated"] is True


def test_vgpu_status_in_the_kernel(ada):
    lab, kernel = ada
    out = lab.execute(kernel, "%vgpu status")
    assert "6.00 GiB" in out
    assert "40%" in out
    assert "simulated" in out
    assert "binpack, overcommit ratio 1.5" in out
    env = lab.execute(kernel, "from jupyter_vgpu.slice import Slice; print(Slice.from_env().memory_limit)")
    assert env.strip() == str(6 * GiB), env


def test_a_quota_change_reaches_the_running_kernel_within_5_seconds(hub, ada):
    lab, kernel = ada
    r = hub.api("PUT", "/vgpu/quotas/users/ada", json={"memory_limit": "3G", "compute_share": 20})
    assert r.status_code == 200, r.text
    out, elapsed = wait_for_status(lab, kernel, "3.00 GiB", timeout=5)
    assert "20%" in out
    print(f"quota change reached the kernel in {elapsed:.2f} s")
    mine = hub.api("GET", "/vgpu/slices/users/ada", token=hub.user_token("ada")).json()
    assert [s["memory_limit"] for s in mine] == [3 * GiB]


def test_a_spawn_that_does_not_fit_fails_with_a_readable_message(hub, ada):
    # ada holds 3 GiB on GPU 0; 118 GiB fits only on the empty GPU 1 (120 GiB with
    # overcommit 1.5), and the next 118 GiB fits nowhere.
    for name in ("bob", "carol"):
        hub.user_token(name)
        assert hub.api("PUT", f"/vgpu/quotas/users/{name}", json={"memory_limit": "118G"}).status_code == 200
    hub.spawn("bob")
    try:
        r = hub.api("POST", "/users/carol/server")
        assert r.status_code >= 400, r.text
        message = r.json()["message"]
        assert "No GPU has room for a 118.00 GiB vGPU slice" in message
        assert "GPU 0" in message
        assert "GPU 1" in message
        page = hub.login("carol").get(f"{hub.url}/hub/spawn-pending/carol")
        assert "No GPU has room" in page.text
        assert "Traceback" not in page.text
    finally:
        hub.stop_server("bob")


def test_quotas_and_slices_survive_a_hub_restart(hub, ada):
    lab, kernel = ada
    before_quotas = hub.api("GET", "/vgpu/quotas").json()
    before = [s for s in hub.api("GET", "/vgpu/slices").json() if s["user"] == "ada"]
    hub.restart()
    assert hub.api("GET", "/vgpu/quotas").json() == before_quotas
    after = [s for s in hub.api("GET", "/vgpu/slices").json() if s["user"] == "ada"]
    assert [s["slice"] for s in after] == [s["slice"] for s in before]
    assert "3.00 GiB" in lab.execute(kernel, "%vgpu status")
    # the restored placement still counts: a change is still checked and applied live
    assert hub.api("PATCH", "/vgpu/quotas/users/ada", json={"memory_limit": "5G"}).status_code == 200
    wait_for_status(lab, kernel, "5.00 GiB", timeout=5)
