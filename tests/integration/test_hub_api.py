"""The Hub's vGPU REST API on a real Hub: permissions, validation, errors, lifecycle."""

import http.client
import json

import pytest

GiB = 2**30
MiB = 2**20
BAD_BODIES = [
    ({"memory_limit": -1}, "memory_limit must be at least 256.00 MiB"),
    ({"memory_limit": 0}, "memory_limit must be at least 256.00 MiB"),
    ({"memory_limit": "many"}, "memory_limit must be a whole number of bytes"),
    ({"memory_limit": "200G"}, "largest GPU allows"),
    # issue 10, defect 5: each of these was stored
    ({"memory_limit": 1.5}, "memory_limit must be a whole number of bytes"),
    ({"memory_limit": 4294967296.7}, "memory_limit must be a whole number of bytes"),
    ({"memory_limit": "1"}, "memory_limit must be at least 256.00 MiB"),
    ({"memory_limit": "0.0000001G"}, "memory_limit must be at least 256.00 MiB"),
    ({"memory_limit": "١٠G"}, "memory_limit must be a whole number of bytes"),
    ({"memory_limit": "1_0G"}, "memory_limit must be a whole number of bytes"),
    ({"memory_limit": "9" * 5000}, "memory_limit must be a whole number of bytes"),
    ({"memory_request": "100M"}, "memory_request must be at least 256.00 MiB"),
    ({"memory_limit": "2G", "memory_request": "3G"}, "memory_request 3.00 GiB is more than memory_limit"),
    ({"compute_share": 0}, "1 to 100"),
    ({"compute_share": 150}, "1 to 100"),
    ({"compute_share": "half"}, "1 to 100"),
    ({"priority": 101}, "priority must be an integer from 0 to 100"),
    ({"priority": "high"}, "priority must be an integer from 0 to 100"),
    ({"gpu_count": 0}, "gpu_count must be an integer from 1 to 16"),
    ({"gpu_count": 3}, "gpu_count 3 is more than a slice can span on this hub: at most 2"),
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
    assert doc["default"] == {
        "memory_limit": 8 * GiB,
        "memory_request": None,
        "compute_share": 50,
        "priority": 50,
        "gpu_count": 1,
    }
    assert doc["overcommit_ratio"] == 1.5
    assert doc["isolation"] == "time-slicing"
    assert doc["compute_share_text"] == "not enforced (time-sliced)"
    assert doc["min_memory_limit"] == 256 * MiB
    assert doc["max_memory_limit"] == 120 * GiB
    assert doc["max_memory_request"] == 80 * GiB
    assert doc["problems"] == []


def test_admin_writes_user_and_group_quotas(hub, users):
    r = hub.api("PUT", "/vgpu/quotas/users/grace", json={"memory_limit": "4G", "compute_share": 25})
    assert r.status_code == 200, r.text
    assert r.json()["memory_limit"] == 4 * GiB
    assert r.json()["effective"]["source"]["memory_limit"] == "user"
    assert r.json()["effective"]["memory_request"] == 4 * GiB
    assert r.json()["effective"]["source"]["memory_request"] == "memory_limit"
    r = hub.api(
        "PATCH",
        "/vgpu/quotas/users/grace",
        json={"compute_share": 30, "memory_request": "1G", "priority": 80},
    )
    assert r.status_code == 200, r.text
    doc = r.json()
    assert (doc["memory_limit"], doc["memory_request"], doc["compute_share"], doc["priority"]) == (
        4 * GiB,
        GiB,
        30,
        80,
    )
    assert doc["effective"]["compute_share_text"] == "not enforced (time-sliced)"
    r = hub.api("PUT", "/vgpu/quotas/groups/students", json={"memory_limit": 12 * GiB})
    assert r.status_code == 200, r.text
    assert hub.api("DELETE", "/vgpu/quotas/users/grace").status_code == 204
    effective = hub.api("GET", "/vgpu/quotas/users/grace").json()["effective"]
    assert effective["memory_limit"] == 12 * GiB
    assert effective["source"]["memory_limit"] == "group:students"
    assert snapshot(hub)["groups"]["students"] == {
        "memory_limit": 12 * GiB,
        "memory_request": None,
        "compute_share": None,
        "priority": None,
        "gpu_count": None,
    }
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
        ("PATCH", "/vgpu/quotas/users/grace", {"priority": 100}),
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
        text = r.json()["message"]
        assert message in text
        for internal in ("float", "int()", "digits)", "Traceback", "NaN to integer"):
            assert internal not in text, text
    assert snapshot(hub) == before


def raw(hub, method, path, body=None):
    """A request whose path reaches the Hub exactly as written (no dot-segment clean-up)."""
    conn = http.client.HTTPConnection("127.0.0.1", hub.port, timeout=30)
    headers = {"Authorization": f"token {hub.admin_token}", "Content-Type": "application/json"}
    conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"null")


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("POST", "/hub/api/vgpu/quotas", 405),
        ("DELETE", "/hub/api/vgpu/slices", 405),
        ("GET", "/hub/api/vgpu/quotas/users/%2e%2e", 404),
        ("GET", "/hub/api/vgpu/quotas/", 404),
        ("GET", "/hub/api/vgpu/quotas/groups/%2e%2e/x", 404),
        ("PUT", "/hub/api/vgpu/nothing/here", 404),
    ],
)
def test_errors_always_carry_a_message(hub, users, method, path, status):
    """Issue 10, defect 5: 404 on %2e%2e and 405 answered "message": null."""
    code, doc = raw(hub, method, path, {} if method in ("POST", "PUT") else None)
    assert code == status
    assert doc["status"] == status
    assert isinstance(doc["message"], str)
    assert doc["message"]


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
        assert hub.api("DELETE", path).status_code == 404
    assert hub.api("GET", "/vgpu/slices/users/nobody").status_code == 404
    assert hub.api("DELETE", "/vgpu/quotas/users/linus").status_code == 404
    assert snapshot(hub) == before


def test_quotas_follow_users_through_delete_and_rename(hub, users):
    """Issue 10, defect 4: a deleted user's quota stayed listed and undeletable, a new
    user of the same name inherited it, and a rename dropped it."""
    hub.user_token("ivy")
    assert hub.api("PUT", "/vgpu/quotas/users/ivy", json={"memory_limit": "2G"}).status_code == 200
    assert hub.api("PATCH", "/users/ivy", json={"name": "ivy2"}).status_code == 200
    assert snapshot(hub)["users"].get("ivy2", {}).get("memory_limit") == 2 * GiB
    assert "ivy" not in snapshot(hub)["users"]
    assert hub.api("GET", "/vgpu/quotas/users/ivy2").json()["effective"]["source"]["memory_limit"] == "user"
    assert hub.api("DELETE", "/users/ivy2").status_code == 204
    assert "ivy2" not in snapshot(hub)["users"]
    assert hub.api("POST", "/users/ivy2").status_code == 201
    effective = hub.api("GET", "/vgpu/quotas/users/ivy2").json()["effective"]
    assert effective["memory_limit"] == 8 * GiB
    assert effective["source"]["memory_limit"] == "default"
    assert hub.api("DELETE", "/users/ivy2").status_code == 204


def test_quotas_follow_groups_through_delete(hub, users):
    """JupyterHub's API cannot rename a group; a rename in its database keeps the quota
    (tests/unit/test_quotas.py)."""
    assert hub.api("POST", "/groups/tmp-group", json={"users": ["linus"]}).status_code == 201
    assert hub.api("PUT", "/vgpu/quotas/groups/tmp-group", json={"compute_share": 90}).status_code == 200
    assert hub.api("GET", "/vgpu/quotas/users/linus").json()["effective"]["compute_share"] == 90
    assert hub.api("DELETE", "/groups/tmp-group").status_code == 204
    assert "tmp-group" not in snapshot(hub)["groups"]
    assert hub.api("GET", "/vgpu/quotas/users/linus").json()["effective"]["compute_share"] == 50
    assert hub.api("POST", "/groups/tmp-group").status_code == 201
    assert hub.api("GET", "/vgpu/quotas/groups/tmp-group").json()["compute_share"] is None
    assert hub.api("DELETE", "/groups/tmp-group").status_code == 204


def test_the_quotas_a_module_changed_are_put_back_as_it_found_them(hub, users):
    """What the shared Hub's fixture does at each module's end (tests/integration/conftest.py),
    so that no module meets another's quotas in whatever order the modules run: a quota
    set since is deleted, one changed or cleared is stored again as it was."""
    hub.user_token("quinn")
    assert (
        hub.api("PUT", "/vgpu/quotas/users/grace", json={"memory_limit": "3G", "priority": 70}).status_code
        == 200
    )
    assert hub.api("PUT", "/vgpu/quotas/groups/students", json={"compute_share": 40}).status_code == 200
    before = hub.quotas()
    assert hub.api("PUT", "/vgpu/quotas/users/grace", json={"memory_limit": "5G"}).status_code == 200
    assert hub.api("PUT", "/vgpu/quotas/users/quinn", json={"compute_share": 30}).status_code == 200
    assert hub.api("DELETE", "/vgpu/quotas/groups/students").status_code == 204
    assert hub.quotas() != before
    hub.restore_quotas(before)
    assert hub.quotas() == before
    grace = hub.api("GET", "/vgpu/quotas/users/grace").json()
    assert (grace["memory_limit"], grace["priority"]) == (3 * GiB, 70)
    assert hub.api("GET", "/vgpu/quotas/users/quinn").json()["compute_share"] is None
    assert hub.api("GET", "/vgpu/quotas/groups/students").json()["compute_share"] == 40
