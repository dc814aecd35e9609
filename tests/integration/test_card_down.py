"""A card that stops answering NVML takes no new slice: a real Hub (simulated cards, one
named in ``JUPYTER_VGPU_NVML_FAIL``) places every server on the other card, even with
``spread``, and its page, REST view and spawn refusals say which card and why."""

import pytest

from jupyter_vgpu import nvml
from jupyter_vgpu.testing.hub_process import HubProcess


@pytest.fixture(scope="module")
def hub():
    process = HubProcess("card-down", extra_env={"JUPYTER_VGPU_DEMO_PLACEMENT": "spread", nvml.FAIL_ENV: "1"})
    try:
        process.start()
        yield process
    finally:
        process.shutdown()


def test_the_hub_places_around_a_card_that_does_not_answer_and_says_so(hub):
    for user in ("cleo", "dev", "eve"):
        hub.login(user)  # the demo's users come into being as they log in
    for user in ("cleo", "dev"):
        hub.spawn(user)
    doc = hub.api("GET", "/vgpu/usage").json()
    placed = {r["user"]: r["gpu_index"] for r in doc["slices"] if r["user"] in ("cleo", "dev")}
    assert placed == {"cleo": 0, "dev": 0}, placed  # spread would have put one on GPU 1
    said = [p for p in doc["problems"] if p.startswith("GPU 1 (")]
    assert said, doc["problems"]
    assert "takes no new slice: the card does not answer NVML" in said[0]
    page = hub.login("admin").get(f"{hub.url}/hub/vgpu")
    assert "GPU 1 (" in page.text
    assert "takes no new slice" in page.text
    # a guarantee only GPU 1 could give (GPU 0 has 2 x 8 GiB guaranteed of 80 GiB) is refused, saying why
    quota = {"memory_limit": "70G", "memory_request": "70G"}
    assert hub.api("PUT", "/vgpu/quotas/users/eve", json=quota).status_code == 200
    events = hub.spawn_events("eve")
    assert events[-1].get("failed"), events
    assert "GPU 1 (" in events[-1]["message"], events[-1]
    assert "takes no slice now" in events[-1]["message"], events[-1]
    for user in ("cleo", "dev"):
        hub.stop_server(user)
