"""Usage at the Hub: servers' reports, who may send them, validation, the REST view,
metrics, the admin page."""

import json

import pytest
import requests

from jupyter_vgpu.testing.documents import kernel_usage, report
from jupyter_vgpu.testing.lab_client import LabClient
from jupyter_vgpu.testing.waiting import wait_for

GiB = 2**30
TOTALS = {"used": 3 * GiB, "reserved": 3 * GiB, "offloaded": 2 * GiB, "offloaded_compressed": GiB}
GPU = {
    "index": 0,
    "uuid": "GPU-sim-0",
    "name": "H100",
    "memory_total": 80 * GiB,
    "memory_used": None,
    "sm_percent": None,
}


@pytest.fixture(scope="module")
def uma(hub):
    """Uma's server, running, with a 4 GiB quota: her own token, and her server's token
    (read, as she could, from a kernel's environment)."""
    token = hub.user_token("uma")
    assert hub.api("PUT", "/vgpu/quotas/users/uma", json={"memory_limit": "4G"}).status_code == 200
    url = hub.spawn("uma")
    lab = LabClient(url, token=token)
    kernel = lab.start_kernel()
    server_token = hub.server_token(lab, kernel)
    lab.shutdown_kernel(kernel)
    yield {"user": token, "server": server_token}
    hub.stop_server("uma")


def uma_row(hub, token=None):
    doc = hub.api("GET", "/vgpu/usage", token=token).json()
    return next((r for r in doc["slices"] if r["user"] == "uma"), None), doc


def body(**usage_changes):
    """A valid report of 3 GiB used by two kernels, with ``usage_changes``."""
    changes = {"totals": TOTALS, "kernels": [kernel_usage("a"), kernel_usage("b")], **usage_changes}
    return report(None, **changes)


def test_the_server_reports_its_usage_to_the_hub_by_itself(hub, uma):
    row = wait_for(
        lambda: (r := uma_row(hub)[0]) and r["report_age"] is not None and r,
        40,  # the server reports every 10 s
        "uma's server to report its usage to the Hub",
    )
    assert row["memory_limit"] == 4 * GiB
    assert row["memory_request"] == 4 * GiB
    assert row["kernels"] == 0
    assert row["stale"] is False


def test_a_report_shows_in_the_usage_view_with_gpus_for_admins(hub, uma):
    assert hub.api("POST", "/vgpu/usage/users/uma", token=uma["server"], json=body()).status_code == 204
    row, doc = uma_row(hub)
    assert (row["used"], row["offloaded"], row["ratio"], row["kernels"]) == (3 * GiB, 2 * GiB, 2.0, 2)
    assert row["compute_share_text"] == "not enforced (time-sliced)"
    gpu = next(g for g in doc["gpus"] if g["uuid"] == row["gpu_uuid"])
    assert gpu["committed"] >= 4 * GiB
    assert gpu["requested"] >= 4 * GiB
    assert gpu["capacity"] == int(80 * GiB * 1.5)
    assert any(s["user"] == "uma" for s in gpu["slices"])


def test_only_the_servers_own_token_may_report(hub, uma):
    """Issue 10, defect 3: a user's own token, an admin's or another user's may not."""
    before, _ = uma_row(hub)
    other = hub.user_token("otto")
    for who, token in (("uma's own", uma["user"]), ("the admin's", hub.admin_token), ("otto's", other)):
        r = hub.api("POST", "/vgpu/usage/users/uma", token=token, json=body())
        assert r.status_code == 403, (who, r.text)
        assert r.json()["message"]
    after, _ = uma_row(hub)
    assert after["used"] == before["used"]


def test_users_see_their_own_usage_only(hub, uma):
    row, doc = uma_row(hub, token=uma["user"])
    assert row is not None
    assert "gpus" not in doc
    assert {r["user"] for r in doc["slices"]} == {"uma"}
    other = hub.user_token("otto")
    assert hub.api("GET", "/vgpu/usage", token=other).json() == {"slices": []}
    assert hub.api("GET", "/vgpu/usage/users/uma", token=other).status_code == 403


@pytest.mark.parametrize(
    ("payload", "status", "message"),
    [
        # Issue 10, defect 2: 10**400 made /hub/metrics answer 500.
        (
            body(totals={**TOTALS, "used": 10**400}),
            400,
            "usage.totals.used: must be at most 9223372036854775807",
        ),
        (body(totals={**TOTALS, "used": 1.5}), 400, "usage.totals.used: must be an integer"),
        (body(totals={**TOTALS, "used": -1}), 400, "usage.totals.used: must be at least 0"),
        (body(gpu={**GPU, "sm_percent": 300}), 400, "usage.gpu.sm_percent: must be at most 100"),
        (body(timestamp=float("inf")), 400, "usage.timestamp: must be a number"),
        (body(kernels=[kernel_usage("a", used=10**30)]), 400, "usage.kernels[0].used: must be at most"),
        (
            body(kernels=[kernel_usage(str(i)) for i in range(1001)]),
            400,
            "usage.kernels: must have at most 1000",
        ),
        (body(kernels=[kernel_usage("a", name="x" * 5000)]), 400, "usage.kernels[0].name: must be at most"),
        ({"usage": {}}, 400, "missing field(s)"),
        ({"server_name": 3, "usage": body()["usage"]}, 400, "server_name: must be a string"),
        ([1], 400, "must be an object"),
        ({**body(), "server_name": "gpu2"}, 403, "may only report for itself"),
    ],
)
def test_bad_reports_are_refused_and_change_nothing(hub, uma, payload, status, message):
    before, _ = uma_row(hub)
    data = json.dumps(payload, allow_nan=True)
    r = hub.api(
        "POST",
        "/vgpu/usage/users/uma",
        token=uma["server"],
        data=data,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == status, r.text
    assert message in r.json()["message"]
    assert "Traceback" not in r.text
    after, _ = uma_row(hub)
    assert after["used"] == before["used"]
    admin = {"Authorization": f"token {hub.admin_token}"}
    assert requests.get(f"{hub.url}/hub/metrics", headers=admin, timeout=30).status_code == 200


def series(text, name, **labels):
    """Values of metric ``name`` whose labels include ``labels``, from Prometheus text."""
    return [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items())
    ]


def test_metrics_carry_per_slice_and_per_gpu_series(hub, uma):
    assert hub.api("POST", "/vgpu/usage/users/uma", token=uma["server"], json=body()).status_code == 204
    admin = {"Authorization": f"token {hub.admin_token}"}
    text = requests.get(f"{hub.url}/hub/metrics", headers=admin, timeout=30).text
    assert series(text, "jupyterhub_vgpu_slice_budget_bytes", user="uma") == [4 * GiB]
    assert series(text, "jupyterhub_vgpu_slice_request_bytes", user="uma") == [4 * GiB]
    assert series(text, "jupyterhub_vgpu_slice_priority", user="uma") == [50]
    assert series(text, "jupyterhub_vgpu_slice_used_bytes", user="uma") == [3 * GiB]
    assert series(text, "jupyterhub_vgpu_slice_offloaded_bytes", user="uma") == [2 * GiB]
    assert series(text, "jupyterhub_vgpu_slice_compression_ratio", user="uma") == [2.0]
    assert sum(series(text, "jupyterhub_vgpu_gpu_slices")) >= 1
    assert sum(series(text, "jupyterhub_vgpu_gpu_committed_bytes")) >= 4 * GiB
    assert series(text, "jupyterhub_vgpu_gpu_memory_bytes", gpu="0") == [80 * GiB]
    users = {"Authorization": f"token {uma['user']}"}
    assert requests.get(f"{hub.url}/hub/metrics", headers=users, timeout=30).status_code == 403


def test_the_admin_page_lists_every_gpu_and_slice_for_admins_only(hub, uma):
    page = hub.login("admin").get(f"{hub.url}/hub/vgpu")
    assert page.status_code == 200
    assert 'data-user="uma"' in page.text
    assert "GPU 0" in page.text
    assert "GPU 1" in page.text
    assert "not enforced (time-sliced)" in page.text
    assert "Guaranteed (requests)" in page.text
    assert 'href="/hub/vgpu"' in page.text  # the navigation link, for admins
    home = hub.login("uma").get(f"{hub.url}/hub/home")
    assert 'href="/hub/vgpu"' not in home.text
    assert hub.login("uma").get(f"{hub.url}/hub/vgpu").status_code == 403


def test_a_stopped_servers_report_is_forgotten(hub):
    """Issue 10: UsageBoard.forget was never called; a stopped server's report stayed."""
    token = hub.user_token("stan")
    url = hub.spawn("stan")
    lab = LabClient(url, token=token)
    kernel = lab.start_kernel()
    server_token = hub.server_token(lab, kernel)
    assert hub.api("POST", "/vgpu/usage/users/stan", token=server_token, json=body()).status_code == 204
    hub.stop_server("stan")
    hub.spawn("stan")
    try:
        row = next(r for r in hub.api("GET", "/vgpu/usage").json()["slices"] if r["user"] == "stan")
        assert row["used"] != 3 * GiB  # the old server's report is gone
        assert row["report_age"] is None or row["kernels"] == 0
    finally:
        hub.stop_server("stan")
