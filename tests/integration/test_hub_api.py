"""The Hub's vGPU REST API on a real Hub: permissions, validation, live changes."""

import pytest

GiB = 2**30
BAD_BODIES = [
    ({"memory_limit": -1}, "positive number of bytes"),
    ({"memory_limit": 0}, "positive number of bytes"),
    ({"memory_limit": "many"}, "positive number of bytes"),
    ({"memory_limit": "200G"}, "largest GPU allows"),
    ({"compute_share": 0}, "1 to 100"),
    ({"compute_share": 150}, "1 to 100"),
    ({"compute_share": "half"}, "1 to 100"),
    ({"memory": "4G"}, "unknown field"),
    ({}, "names no field"),
    ([1, 2], "JSON object"),
]


@pytest.fixture(scope="module")
def users(hub):
    """Tokens of two ordinary users, and a group holding one of them."""
    tokens = {name: hub.user_token(name) for name in ("grace", "linus")}
    r = hub.api("POST", "/groups/students", json={"users": ["grace"]})
    assert r.status_code in (201, 409), r.text
    return tokens


def snapshot(hub):
    return hub.api("GET", "/vgpu/quotas").json()


def test_admin_reads_every_quota(hub, users):
    doc = snapshot(hub)
    assert doc["default"] == {"memory_limit": 8 * GiB, "compute_share": 50}
    assert doc["overcommit_ratio"] == 1.5
    assert doc["max_memory_limit"] == 120 * GiB


def test_admin_writes_user_and_group_quotas(hub, users):
    r = hub.api("PUT", "/vgpu/quotas/users/grace", json={"memory_limit": "4G", "compute_share": 25})
    assert r.status_code == 200, r.text
    assert r.json()["memory_limit"] == 4 * GiB
    assert r.json()["effective"]["source"] == {"memory_limit": "user", "compute_share": "user"}
    r = hub.api("PATCH", "/vgpu/quotas/users/grace", json={"compute_share": 30})
    assert (r.json()["memory_limit"], r.json()["compute_share"]) == (4 * GiB, 30)
    r = hub.api("PUT", "/vgpu/quotas/groups/students", json={"memory_limit": 12 * GiB})
    assert r.status_code == 200, r.text
    assert hub.api("DELETE", "/vgpu/quotas/users/grace").status_code == 204
    effective = hub.api("GET", "/vgpu/quotas/users/grace").json()["effective"]
    assert effective["memory_limit"] == 12 * GiB
    assert effective["source"]["memory_limit"] == "group:students"
    assert snapshot(hub)["groups"]["students"] == {"memory_limit": 12 * GiB, "compute_share": None}
    assert hub.api("DELETE", "/vgpu/quotas/groups/students").status_code == 204
    assert hub.api("DELETE", "/vgpu/quotas/groups/students").status_code == 404


def test_users_read_their_own_and_nothing_else(hub, users):
    grace = users["grace"]
    r = hub.api("GET", "/vgpu/quotas/users/grace", token=grace)
    assert r.status_code == 200
    assert r.json()["effective"]["memory_limit"] > 0
    assert hub.api("GET", "/vgpu/slices/users/grace", token=grace).json() == []
    for method, path in [
        ("GET", "/vgpu/quotas/users/linus"),
        ("GET", "/vgpu/slices/users/linus"),
        ("GET", "/vgpu/quotas"),
        ("GET", "/vgpu/slices"),
        ("GET", "/vgpu/quotas/groups/students"),
    ]:
        r = hub.api(method, path, token=grace)
        assert r.status_code == 403, (method, path, r.text)
        assert r.json()["message"]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("PUT", "/vgpu/quotas/users/grace", {"memory_limit": "100G"}),
        ("PATCH", "/vgpu/quotas/users/grace", {"compute_share": 100}),
        ("DELETE", "/vgpu/quotas/users/grace", None),
        ("PUT", "/vgpu/quotas/users/linus", {"compute_share": 100}),
        ("PUT", "/vgpu/quotas/groups/students", {"compute_share": 100}),
    ],
)
def test_non_admin_writes_are_refused_and_store_nothing(hub, users, method, path, body):
    before = snapshot(hub)
    r = hub.api(method, path, token=users["grace"], json=body)
    assert r.status_code == 403
    assert r.json()["status"] == 403
    assert "admin:" in r.json()["message"]
    assert snapshot(hub) == before


@pytest.mark.parametrize(("body", "message"), BAD_BODIES)
@pytest.mark.parametrize("kind", ["users/linus", "groups/students"])
def test_bad_input_is_refused_and_stores_nothing(hub, users, body, message, kind):
    before = snapshot(hub)
    for method in ("PUT", "PATCH"):
        r = hub.api(method, f"/vgpu/quotas/{kind}", json=body)
        assert r.status_code == 400, r.text
        assert message in r.json()["message"]
    assert snapshot(hub) == before


def test_malformed_json_unknown_names_and_empty_body(hub, users):
    before = snapshot(hub)
    r = hub.api(
        "PUT", "/vgpu/quotas/users/linus", data="{not json", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400
    assert "JSON" in r.json()["message"]
    assert hub.api("PUT", "/vgpu/quotas/users/linus").status_code == 400
    for path in ("/vgpu/quotas/users/nobody", "/vgpu/quotas/groups/nogroup"):
        r = hub.api("PUT", path, json={"compute_share": 10})
        assert r.status_code == 404
        assert "No such" in r.json()["message"]
        assert hub.api("GET", path).status_code == 404
    assert hub.api("GET", "/vgpu/slices/users/nobody").status_code == 404
    assert hub.api("DELETE", "/vgpu/quotas/users/linus").status_code == 404
    assert snapshot(hub) == before
