"""Usage at the Hub: servers' reports, the REST view, permissions, metrics, admin page."""

import time

import pytest
import requests

GiB = 2**30
REPORT = {
    "server_name": "",
    "usage": {
        "simulated": True,
        "gpu": {"sm_percent": None},
        "totals": {"used": 3 * GiB, "reserved": 3 * GiB, "offloaded": 2 * GiB, "offloaded_compressed": GiB},
        "kernels": [{}, {}],
    },
}


@pytest.fixture(scope="module")
def uma(hub):
    """Uma's server, running, with a 4 GiB quota; her token."""
    token = hub.user_token("uma")
    assert hub.api("PUT", "/vgpu/quotas/users/uma", json={"memory_limit": "4G"}).status_code == 200
    hub.spawn("uma")
    yield token
    hub.stop_server("uma")


def uma_row(hub, token=None):
    doc = hub.api("GET", "/vgpu/usage", token=token).json()
    return next((r for r in doc["slices"] if r["user"] == "uma"), None), doc


def test_the_server_reports_its_usage_to_the_hub_by_itself(hub, uma):
    deadline = time.monotonic() + 40  # the server reports every 10 s
    row = None
    while time.monotonic() < deadline:
        row, _ = uma_row(hub)
        if row and row["report_age"] is not None:
            break
        time.sleep(0.5)
    assert row["report_age"] is not None, row
    assert row["memory_limit"] == 4 * GiB
    assert row["kernels"] == 0
    assert row["stale"] is False


def test_a_report_shows_in_the_usage_view_with_gpus_for_admins(hub, uma):
    assert hub.api("POST", "/vgpu/usage/users/uma", token=uma, json=REPORT).status_code == 204
    row, doc = uma_row(hub)
    assert (row["used"], row["offloaded"], row["ratio"], row["kernels"]) == (3 * GiB, 2 * GiB, 2.0, 2)
    gpu = next(g for g in doc["gpus"] if g["uuid"] == row["gpu_uuid"])
    assert gpu["committed"] >= 4 * GiB
    assert gpu["capacity"] == int(80 * GiB * 1.5)
    assert any(s["user"] == "uma" for s in gpu["slices"])


def test_users_see_their_own_usage_only_and_cannot_report_for_others(hub, uma):
    row, doc = uma_row(hub, token=uma)
    assert row is not None
    assert "gpus" not in doc
    assert {r["user"] for r in doc["slices"]} == {"uma"}
    other = hub.user_token("otto")
    assert hub.api("GET", "/vgpu/usage", token=other).json() == {"slices": []}
    assert hub.api("GET", "/vgpu/usage/users/uma", token=other).status_code == 403
    r = hub.api("POST", "/vgpu/usage/users/uma", token=other, json=REPORT)
    assert r.status_code == 403
    assert r.json()["message"]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"usage": {}}, 400, "usage.totals"),
        ({"server_name": 3, "usage": {}}, 400, "server_name"),
        ({"usage": {**REPORT["usage"], "totals": {"used": -1}}}, 400, "usage.totals"),
        ({"usage": {**REPORT["usage"], "gpu": {"sm_percent": 300}}}, 400, "sm_percent"),
        ([1], 400, "the body must be"),
        ({"server_name": "gpu2", "usage": REPORT["usage"]}, 404, "no running server 'gpu2'"),
    ],
)
def test_bad_reports_are_refused_and_change_nothing(hub, uma, body, status, message):
    before, _ = uma_row(hub)
    r = hub.api("POST", "/vgpu/usage/users/uma", token=uma, json=body)
    assert r.status_code == status
    assert message in r.json()["message"]
    after, _ = uma_row(hub)
    assert after["used"] == before["used"]


def series(text, name, **labels):
    """Values of metric ``name`` whose labels include ``labels``, from Prometheus text."""
    return [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items())
    ]


def test_metrics_carry_per_slice_and_per_gpu_series(hub, uma):
    assert hub.api("POST", "/vgpu/usage/users/uma", token=uma, json=REPORT).status_code == 204
    admin = {"Authorization": f"token {hub.admin_token}"}
    text = requests.get(f"{hub.url}/hub/metrics", headers=admin, timeout=30).text
    assert series(text, "jupyterhub_vgpu_slice_budget_bytes", user="uma") == [4 * GiB]
    assert series(text, "jupyterhub_vgpu_slice_used_bytes", user="uma") == [3 * GiB]
    assert series(text, "jupyterhub_vgpu_slice_offloaded_bytes", user="uma") == [2 * GiB]
    assert series(text, "jupyterhub_vgpu_slice_compression_ratio", user="uma") == [2.0]
    assert sum(series(text, "jupyterhub_vgpu_gpu_slices")) >= 1
    assert sum(series(text, "jupyterhub_vgpu_gpu_committed_bytes")) >= 4 * GiB
    assert series(text, "jupyterhub_vgpu_gpu_memory_bytes", gpu="0") == [80 * GiB]
    users = {"Authorization": f"token {uma}"}
    assert requests.get(f"{hub.url}/hub/metrics", headers=users, timeout=30).status_code == 403


def test_the_admin_page_lists_every_gpu_and_slice_for_admins_only(hub, uma):
    page = hub.login("admin").get(f"{hub.url}/hub/vgpu")
    assert page.status_code == 200
    assert 'data-user="uma"' in page.text
    assert "GPU 0" in page.text
    assert "GPU 1" in page.text
    assert 'href="/hub/vgpu"' in page.text  # the navigation link, for admins
    home = hub.login("uma").get(f"{hub.url}/hub/home")
    assert 'href="/hub/vgpu"' not in home.text
    assert hub.login("uma").get(f"{hub.url}/hub/vgpu").status_code == 403
