"""The inventory: simulation only when asked, a clear failure without a driver, MIG
instances (simulated here; real ones through NVML on a GPU host), isolation per GPU."""

import logging

import pytest
from traitlets import TraitError
from traitlets.config import Config

from hub_spawner.config import VGPUHub
from hub_spawner.inventory import GPUInventory
from hub_spawner.placement import PlacementError
from jupyter_vgpu import nvml

GiB = 2**30
MIG = ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]


def inventory(**traits):
    return GPUInventory(config=Config({"GPUInventory": traits}))


@pytest.mark.skipif(nvml.available(), reason="this host has an NVIDIA driver")
def test_without_a_driver_nothing_is_invented_and_the_reason_is_logged(caplog):
    inv = inventory()
    assert inv.simulate is False
    with caplog.at_level(logging.ERROR):
        assert inv.cards == []
    assert inv.error.startswith("NVML failed on this host")
    assert "spawns will be refused" in caplog.text
    devices, problems = inv.devices()
    assert devices == []
    assert problems == [inv.error]


@pytest.mark.skipif(nvml.available(), reason="this host has an NVIDIA driver")
def test_a_hub_without_gpus_refuses_spawns_with_the_reason():
    hub = VGPUHub(config=Config())
    with pytest.raises(PlacementError, match="cannot place vGPU slices: NVML failed on this host"):
        hub.allocator.place("ada/", 8 * GiB, 50)


def test_simulation_when_asked():
    inv = inventory(simulate=True, simulated_count=3, simulated_memory="40G")
    devices, problems = inv.devices()
    assert problems == []
    assert [(g.index, g.memory, g.simulated, g.isolation) for g in devices] == [
        (i, 40 * GiB, True, "time-slicing") for i in range(3)
    ]
    assert inv.error is None
    with pytest.raises(TraitError):
        inventory(simulate=None)


def test_simulated_mig_instances():
    inv = inventory(simulate=True, simulated_mig_profiles={"1": MIG})
    devices, problems = inv.devices("time-slicing")
    assert problems == []
    assert [g.label for g in devices] == [
        "GPU 0",
        "GPU 1 MIG 3g.40gb",
        "GPU 1 MIG 2g.20gb",
        "GPU 1 MIG 1g.10gb",
        "GPU 1 MIG 1g.10gb",
    ]
    mig = devices[1]
    assert mig.uuid.startswith("MIG-sim-")
    assert (mig.memory, mig.isolation, mig.compute_percent, mig.exclusive) == (40 * GiB, "mig", 43, True)
    assert mig.name.endswith(" MIG 3g.40gb")
    assert len({g.uuid for g in devices}) == 5


def test_isolation_per_hub_and_per_gpu():
    inv = inventory(simulate=True, simulated_count=3)
    third = "GPU-sim-00000002-0000-4000-8000-000000000000"
    devices, _ = inv.devices("mps", {"1": "time-slicing", third: "mps"})
    assert [g.isolation for g in devices] == ["mps", "time-slicing", "mps"]
    devices, problems = inv.devices("time-slicing", {"2": "mig"})
    assert [g.index for g in devices] == [0, 1]
    assert "GPU 2" in problems[0]
    assert "not in MIG mode" in problems[0]


@pytest.mark.parametrize("bad", [{"x": MIG}, {"1": ["3g"]}, {"1": ["40gb"]}, {"١": MIG}])
def test_bad_simulated_profiles_are_refused(bad):
    with pytest.raises(TraitError):
        inventory(simulate=True, simulated_mig_profiles=bad)


def test_a_card_that_stops_answering_nvml_takes_no_new_slice_until_it_answers_again(monkeypatch):
    """A card whose NVML queries fail (as one that fell off the bus: here named in
    JUPYTER_VGPU_NVML_FAIL, which simulated cards honour too) takes no new slice; the
    Hub says so and places on the others; once it answers, it takes slices again."""
    from jupyter_vgpu.testing.waiting import wait_for

    config = Config({"GPUInventory": {"simulate": True, "simulated_mig_profiles": {"2": ["1g.10gb"]}}})
    config.GPUInventory.simulated_count = 3
    hub = VGPUHub(config=config)
    hub.inventory = GPUInventory(config=config)
    monkeypatch.setenv(nvml.FAIL_ENV, "1,2")
    down = hub.check_devices()
    assert sorted(down) == sorted(g.uuid for g in hub.allocator.gpus if g.index in (1, 2))  # MIG too
    assert any(p.startswith("GPU 1 (") and "takes no new slice: the card does not answer NVML" in p
               for p in hub.problems)  # fmt: skip
    assert [hub.allocator.place(f"u{i}/", 8 * GiB, 10, "spread").index for i in range(3)] == [0, 0, 0]
    with pytest.raises(PlacementError, match="takes no slice now"):
        hub.allocator.place_instance("m/", "1g.10gb", 80 * GiB)
    monkeypatch.delenv(nvml.FAIL_ENV)
    wait_for(lambda: not hub.check_devices(), 10, "the cards to take slices again")
    assert hub.allocator.place("v/", 8 * GiB, 10, "spread").index == 1
    assert not [p for p in hub.problems if "takes no new slice" in p]


def test_the_hubs_look_at_the_cards_runs_off_its_event_loop_and_is_shared(monkeypatch):
    """NVML's look at a card that fell off the bus may take seconds: the Hub makes it in
    a thread, its event loop runs on meanwhile, and requests at the same time share one
    look. (The slow card is a stand-in wrapped around the real look: NVML cannot be made
    slow here.)"""
    import asyncio
    import threading

    config = Config({"GPUInventory": {"simulate": True}})
    hub = VGPUHub(config=config)
    hub.inventory = GPUInventory(config=config)
    answered, looks = threading.Event(), []
    real = hub.inventory.down

    def slow(devices):
        looks.append(threading.get_ident())
        answered.wait(30)
        return real(devices)

    monkeypatch.setattr(hub.inventory, "down", slow)
    monkeypatch.setenv(nvml.FAIL_ENV, "1")

    async def requests() -> tuple[int, dict, dict]:
        first = asyncio.ensure_future(hub.devices_checked())
        second = asyncio.ensure_future(hub.devices_checked())
        for _ in range(500):  # the loop goes on while the look waits for the card
            await asyncio.sleep(0.01)
            if looks:
                break
        assert looks, "no look at the cards began"
        assert not first.done()
        assert not second.done()
        answered.set()
        return threading.get_ident(), await first, await second

    loop_thread, first, second = asyncio.run(requests())
    assert len(looks) == 1, "two requests at the same time made two looks"
    assert looks[0] != loop_thread, "the look ran on the event loop's thread"
    assert first == second == {hub.allocator.gpus[1].uuid: first[hub.allocator.gpus[1].uuid]}
