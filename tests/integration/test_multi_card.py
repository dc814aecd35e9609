"""A slice of several cards through the real demo Hub (two simulated GPUs): the card
count is a quota field with the same validation as the others, the spawner places both
cards in one decision or none, and the server and its kernels see every card."""

import json
import re

import pytest

from jupyter_vgpu.testing.lab_client import LabClient

GiB = 2**30


@pytest.fixture(scope="module")
def two_card_user(hub):
    token = hub.user_token("ines")
    yield token
    if hub.api("GET", "/users/ines").json().get("servers"):
        hub.stop_server("ines")


def test_a_card_count_the_host_cannot_hold_is_refused_and_nothing_is_stored(hub, two_card_user):
    for body, message in (
        (
            {"gpu_count": 3, "memory_limit": "4G"},
            "gpu_count 3 is more than a slice can span on this hub: at most 2",
        ),
        ({"gpu_count": 0}, "gpu_count must be an integer from 1 to 16"),
        ({"gpu_count": "2"}, "gpu_count must be an integer from 1 to 16"),
    ):
        r = hub.api("PUT", "/vgpu/quotas/users/ines", json=body)
        assert r.status_code == 400, r.text
        assert message in r.json()["message"]
        stored = hub.api("GET", "/vgpu/quotas/users/ines").json()
        assert (stored["gpu_count"], stored["memory_limit"]) == (None, None)
        assert stored["effective"]["gpu_count"] == 1
    assert hub.api("GET", "/vgpu/quotas").json()["max_gpu_count"] == 2


def test_a_two_card_slice_is_placed_whole_and_its_kernel_sees_both_cards(hub, two_card_user):
    quota = {"gpu_count": 2, "memory_limit": "40G", "memory_request": "4G"}
    r = hub.api("PUT", "/vgpu/quotas/users/ines", json=quota)
    assert r.status_code == 200, r.text
    assert r.json()["effective"]["gpu_count"] == 2
    events = hub.spawn_events("ines")
    assert events[-1].get("ready"), events
    placed = [e["message"] for e in events if "vGPU slice" in e.get("message", "")]
    assert "simulated GPUs 0 and 1 (" in placed[0], placed
    assert "40.00 GiB budget on each, 4.00 GiB guaranteed" in placed[0], placed
    row = next(s for s in hub.api("GET", "/vgpu/slices").json() if s["user"] == "ines")
    cards = [row["slice"]["gpu_uuid"], *(c["uuid"] for c in row["slice"]["more_gpus"])]
    assert len(set(cards)) == 2, row
    assert row["slice"]["memory_limit"] == 40 * GiB
    # the Hub's books: the slice's limit and request on each card; the page shows it on each
    gpus = {g["uuid"]: g for g in hub.api("GET", "/vgpu/usage").json()["gpus"]}
    for uuid in cards:
        ines = [r for r in gpus[uuid]["slices"] if r["user"] == "ines"]
        assert [(r["memory_limit"], r["memory_request"], r["gpu_indices"]) for r in ines] == [
            (40 * GiB, 4 * GiB, [0, 1])
        ]
    page = hub.login("admin").get(f"{hub.url}/hub/vgpu").text
    assert page.count("GPUs 0 + 1</span>") == 2, page
    lab = LabClient(hub.spawn("ines"), token=two_card_user)
    kernel = lab.start_kernel()
    try:
        seen = json.loads(lab.execute(kernel, "import os; print(os.environ['JUPYTER_VGPU_SLICE'])"))
        assert [seen["gpu_uuid"], *(c["uuid"] for c in seen["more_gpus"])] == cards
        usage = lab.get("api/vgpu/usage").json()  # the server's document, a card each
        assert [usage["gpu"]["uuid"], *(g["uuid"] for g in usage["more_gpus"])] == cards, usage
        status = lab.execute(kernel, "%vgpu status")
        assert "2 cards of" in status, status
        for device, uuid in enumerate(cards):
            assert re.search(rf"cuda:{device}\s+index {device}, {uuid}: budget 40\.00 GiB", status), status
    finally:
        lab.shutdown_kernel(kernel)


def test_two_cards_without_room_on_both_are_refused_and_nothing_is_placed(hub, two_card_user):
    hub.user_token("jon")
    quota = {"gpu_count": 2, "memory_limit": "100G", "memory_request": "78G"}
    assert hub.api("PUT", "/vgpu/quotas/users/jon", json=quota).status_code == 200
    events = hub.spawn_events("jon")
    assert events[-1].get("failed"), events
    message = events[-1]["message"]
    assert (
        "No host has 2 GPUs with room for a vGPU slice of 100.00 GiB on each (78.00 GiB guaranteed)"
        in message
    )
    assert not [s for s in hub.api("GET", "/vgpu/slices").json() if s["user"] == "jon"]
    # smaller, the two cards fit beside ines's
    smaller = {"memory_limit": "40G", "memory_request": "8G"}
    assert hub.api("PATCH", "/vgpu/quotas/users/jon", json=smaller).status_code == 200
    events = hub.spawn_events("jon")
    assert events[-1].get("ready"), events
    hub.stop_server("jon")
