"""Placement: binpack, spread, requests and limits, overcommit, MIG instances, refusal, resize."""

import pytest

from hub_spawner.inventory import GPU
from hub_spawner.placement import Allocator, Placement, PlacementError

GiB = 2**30


def gpus(n=2, memory=80 * GiB):
    return [GPU(i, f"GPU-{i}", "H100", memory, simulated=True) for i in range(n)]


def instances(*profiles, index=1):
    return [
        GPU(index, f"MIG-{n}", f"H100 MIG {p}", int(p[3:-2]) * GiB, True, "mig", p, 14 * int(p[0]))
        for n, p in enumerate(profiles)
    ]


def test_binpack_fills_the_fullest_gpu_that_fits():
    a = Allocator(gpus())
    assert a.place("a/", 30 * GiB, 50).index == 0
    assert a.place("b/", 30 * GiB, 50).index == 0  # GPU 0 is fuller and still fits
    assert a.place("c/", 30 * GiB, 50).index == 1  # 20 GiB left on GPU 0
    assert a.place("d/", 20 * GiB, 50).index == 0  # exactly fills GPU 0


def test_spread_takes_the_emptiest_gpu():
    a = Allocator(gpus(3))
    chosen = [a.place(f"u{i}/", 10 * GiB, 10, "spread").index for i in range(4)]
    assert chosen == [0, 1, 2, 0]


def test_overcommit_lets_budgets_sum_past_the_card():
    a = Allocator(gpus(1), overcommit_ratio=1.5, unavailable="x")
    for i in range(3):
        a.place(f"u{i}/", 40 * GiB, 100, memory_request=20 * GiB)
    assert a.committed(a.gpus[0]) == 120 * GiB
    assert a.requested(a.gpus[0]) == 60 * GiB
    with pytest.raises(PlacementError):
        a.place("u3/", 1, 100)
    assert Allocator(gpus(1)).largest_budget() == 80 * GiB
    assert a.largest_budget() == 120 * GiB


def test_requests_sum_to_the_card_and_limits_to_ratio_times_the_card():
    a = Allocator(gpus(1), overcommit_ratio=2.0)
    a.place("a/", 60 * GiB, 50, memory_request=50 * GiB)
    # 100 GiB of limit is left, but only 30 GiB of guarantee
    with pytest.raises(PlacementError, match=r"40.00 GiB guaranteed"):
        a.place("b/", 60 * GiB, 50, memory_request=40 * GiB)
    assert a.place("b/", 60 * GiB, 50, memory_request=30 * GiB).index == 0
    assert a.free_request(a.gpus[0]) == 0
    assert a.free(a.gpus[0]) == 40 * GiB
    # a burstable slice with a small guarantee still fits where a whole one does not
    with pytest.raises(PlacementError):
        a.place("c/", 40 * GiB, 50)
    with pytest.raises(ValueError, match="more than memory_limit"):
        a.place("c/", GiB, 50, memory_request=2 * GiB)


def test_binpack_compares_guarantees_first():
    a = Allocator(gpus(2), overcommit_ratio=2.0)
    a.place("a/", 80 * GiB, 50, memory_request=10 * GiB)  # GPU 0: little guaranteed, much budget
    a.place("b/", 20 * GiB, 50, memory_request=20 * GiB)  # binpack: GPU 0 (fullest)
    assert a.placements["b/"].gpu_uuid == "GPU-0"
    a2 = Allocator(gpus(2), overcommit_ratio=2.0)
    a2.place("a/", 10 * GiB, 50)
    a2.place("x/", 90 * GiB, 50, memory_request=5 * GiB, policy="spread")
    assert a2.placements["x/"].gpu_uuid == "GPU-1"


def test_refusal_names_every_gpu_and_the_request():
    a = Allocator(gpus(2))
    a.place("a/", 70 * GiB, 100)
    a.place("b/", 75 * GiB, 100)
    with pytest.raises(PlacementError) as e:
        a.place("c/", 40 * GiB, 100)
    message = str(e.value)
    assert message.startswith("No GPU has room for a 40.00 GiB vGPU slice:")
    assert "GPU 0 (H100) has 10.00 GiB left" in message
    assert "GPU 1 (H100) has 5.00 GiB left" in message
    assert e.value.jupyterhub_message == message
    assert "c/" not in a.placements


def test_no_device_refuses_with_the_reason():
    a = Allocator([], unavailable="NVML failed on this host: no driver")
    assert a.largest_budget() == 0
    with pytest.raises(PlacementError, match="cannot place vGPU slices: NVML failed on this host: no driver"):
        a.place("a/", GiB, 50)


def test_replacing_a_key_does_not_count_it_twice():
    a = Allocator(gpus(1))
    a.place("a/", 60 * GiB, 100)
    a.place("a/", 70 * GiB, 100)  # a restart of the same server
    assert a.committed(a.gpus[0]) == 70 * GiB


def test_resize_checks_limits_and_requests_and_changes_nothing_on_refusal():
    a = Allocator(gpus(1), overcommit_ratio=1.5)
    a.place("a/", 40 * GiB, 50)
    a.place("b/", 30 * GiB, 50)
    a.resize("a/", 50 * GiB, 20)
    assert a.placements["a/"] == Placement("a/", "GPU-0", 50 * GiB, 20, 50 * GiB)
    with pytest.raises(PlacementError, match=r"cannot guarantee a/'s slice 60.00 GiB"):
        a.resize("a/", 60 * GiB, 20)
    a.resize("a/", 60 * GiB, 20, memory_request=40 * GiB)  # burstable: fits
    with pytest.raises(PlacementError, match="cannot grow a/"):
        a.resize("a/", 100 * GiB, 20, memory_request=GiB)
    assert a.placements["a/"].memory_limit == 60 * GiB
    a.resize("a/", 1 * GiB, 20)  # shrinking always fits


def test_restore_is_unchecked_but_needs_a_known_gpu():
    a = Allocator(gpus(1))
    a.restore(Placement("a/", "GPU-0", 90 * GiB, 100))
    assert a.free(a.gpus[0]) == -10 * GiB
    with pytest.raises(KeyError):
        a.restore(Placement("b/", "GPU-9", GiB, 100))


def test_release_and_bad_arguments():
    a = Allocator(gpus(1))
    a.place("a/", GiB, 1)
    a.release("a/")
    a.release("a/")
    assert a.placements == {}
    with pytest.raises(ValueError, match="placement must be"):
        a.place("a/", GiB, 1, "random")
    with pytest.raises(ValueError, match="overcommit_ratio"):
        Allocator(gpus(1), overcommit_ratio=0.5)


def test_mig_instances_are_given_whole_without_overcommit():
    a = Allocator(gpus(1) + instances("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"), overcommit_ratio=1.5)
    got = a.place_instance("a/", "1g.10gb", max_memory=16 * GiB)
    assert got.uuid == "MIG-2"
    assert a.placements["a/"] == Placement("a/", "MIG-2", 10 * GiB, 14, 10 * GiB)
    assert a.capacity(got) == 10 * GiB  # no overcommit on an instance
    assert a.place_instance("b/", "1g.10gb", max_memory=16 * GiB).uuid == "MIG-3"
    with pytest.raises(PlacementError, match=r"Every MIG instance of profile 1g.10gb is taken"):
        a.place_instance("c/", "1g.10gb", max_memory=16 * GiB)
    with pytest.raises(PlacementError, match=r"3g.40gb \(40.00 GiB\) is more than your vGPU quota of 16.00"):
        a.place_instance("c/", "3g.40gb", max_memory=16 * GiB)
    with pytest.raises(PlacementError, match=r"no MIG profile '7g.80gb'"):
        a.place_instance("c/", "7g.80gb", max_memory=80 * GiB)
    # no profile named: the largest free instance within the quota
    assert a.place_instance("c/", None, max_memory=32 * GiB).mig_profile == "2g.20gb"
    # shared placement never lands on an instance
    assert a.place("d/", 8 * GiB, 50).uuid == "GPU-0"
    assert a.largest_budget() == 120 * GiB


def test_profiles_say_what_fits_the_quota_and_what_is_free():
    a = Allocator(instances("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"))
    a.place_instance("a/", "1g.10gb", max_memory=10 * GiB)
    rows = {r["profile"]: r for r in a.profiles(max_memory=20 * GiB)}
    assert rows["1g.10gb"] == {
        "profile": "1g.10gb",
        "memory": 10 * GiB,
        "compute_percent": 14,
        "total": 2,
        "free": 1,
        "fits": True,
    }
    assert rows["2g.20gb"]["fits"] is True
    assert rows["3g.40gb"]["fits"] is False
    assert [r["profile"] for r in a.profiles(max_memory=GiB)] == ["1g.10gb", "2g.20gb", "3g.40gb"]
    with pytest.raises(PlacementError, match="only MIG instances"):
        a.place("b/", GiB, 50)


def test_a_quota_change_never_resizes_a_mig_instance():
    a = Allocator(instances("1g.10gb"))
    a.place_instance("a/", "1g.10gb", max_memory=10 * GiB)
    a.check_resize("a/", 50 * GiB)
    assert a.resize("a/", 50 * GiB, 100).memory_limit == 10 * GiB


def test_a_card_out_of_service_takes_no_slice_and_the_refusal_says_why():
    a = Allocator(gpus(2))
    a.down = {"GPU-1": "the card does not answer NVML"}
    chosen = [
        a.place(f"u{i}/", 10 * GiB, 10, policy).index for i, policy in enumerate(["spread", "binpack"] * 2)
    ]
    assert chosen == [0, 0, 0, 0]  # spread too: GPU 1 is empty but takes nothing
    with pytest.raises(PlacementError) as refused:
        a.place("big/", 60 * GiB, 100)  # GPU 0 has 40 GiB left, GPU 1 would have room
    assert "GPU 1 (H100) takes no slice now: the card does not answer NVML" in str(refused.value)
    assert "big/" not in a.placements  # nothing stored
    a.down = {}  # the card answers again
    assert a.place("big/", 60 * GiB, 100).index == 1


def test_mig_instances_of_a_card_out_of_service_are_not_given():
    a = Allocator(instances("1g.10gb", "1g.10gb"))
    a.down = {"MIG-0": "the card does not answer NVML"}
    assert a.place_instance("a/", "1g.10gb", 80 * GiB).uuid == "MIG-1"
    with pytest.raises(
        PlacementError, match=r"taken or on a card that takes no slice now \(2 on this hub: the card does not"
    ):
        a.place_instance("b/", "1g.10gb", 80 * GiB)


def test_a_slice_of_several_cards_is_placed_whole_with_its_budget_on_each():
    a = Allocator(gpus(4), overcommit_ratio=1.0)
    a.place("small/", 30 * GiB, 50)  # GPU 0 is the fullest
    cards = a.place_cards("pair/", 40 * GiB, 50, count=2)
    assert [g.index for g in cards] == [0, 1]  # binpack: the fullest card that fits, then the next
    assert a.placements["pair/"].gpu_uuids == ("GPU-0", "GPU-1")
    assert [a.committed(g) for g in a.gpus] == [70 * GiB, 40 * GiB, 0, 0]
    spread = a.place_cards("wide/", 20 * GiB, 50, "spread", count=2)
    assert [g.index for g in spread] == [2, 3]  # the two emptiest
    a.release("pair/")
    assert [a.committed(g) for g in a.gpus] == [30 * GiB, 0, 20 * GiB, 20 * GiB]


def test_a_slice_of_several_cards_is_never_half_placed():
    a = Allocator(gpus(2))
    a.place("big/", 70 * GiB, 50)
    with pytest.raises(PlacementError) as refused:
        a.place_cards("pair/", 40 * GiB, 50, count=2)
    assert "No host has 2 GPUs with room for a vGPU slice of 40.00 GiB on each" in str(refused.value)
    assert "GPU 0 (H100) has 10.00 GiB left" in str(refused.value)
    assert "pair/" not in a.placements
    assert [a.committed(g) for g in a.gpus] == [70 * GiB, 0]
    with pytest.raises(PlacementError, match="No host has 3 GPUs"):
        a.place_cards("three/", GiB, 50, count=3)
    with pytest.raises(ValueError, match="count must be at least 1"):
        a.place_cards("none/", GiB, 50, count=0)


def test_the_cards_of_a_slice_are_on_one_host():
    nodes = [GPU(i % 2, f"GPU-{n}{i}", "H100", 80 * GiB, True, node=n) for n in "ab" for i in range(2)]
    a = Allocator([*nodes, GPU(2, "GPU-b2", "H100", 80 * GiB, True, node="b")])
    a.place("x/", 60 * GiB, 50, only=lambda g: g.uuid == "GPU-a0")
    assert a.most_cards() == 3
    cards = a.place_cards("pair/", 40 * GiB, 50, count=2)
    assert {g.node for g in cards} == {"b"}  # node a has one card with 40 GiB free
    cards = a.place_cards("three/", 30 * GiB, 50, count=3)
    assert {g.node for g in cards} == {"b"}


def test_a_slice_of_several_cards_resizes_on_each_and_restores():
    a = Allocator(gpus(2))
    a.place_cards("pair/", 40 * GiB, 50, count=2)
    a.place("other/", 30 * GiB, 50, "spread")
    with pytest.raises(PlacementError, match=r"cannot grow pair/'s slice to 60\.00 GiB"):
        a.resize("pair/", 60 * GiB, 50)
    assert a.placements["pair/"].memory_limit == 40 * GiB
    a.resize("pair/", 50 * GiB, 50)
    assert a.placements["pair/"].gpu_uuids == ("GPU-0", "GPU-1")
    assert [a.committed(g) for g in a.gpus] == [80 * GiB, 50 * GiB]
    b = Allocator(gpus(2))
    b.restore(a.placements["pair/"])
    assert [b.committed(g) for g in b.gpus] == [50 * GiB, 50 * GiB]
    with pytest.raises(KeyError):
        b.restore(Placement("lost/", "GPU-0", GiB, 50, more_gpus=("GPU-9",)))


def test_mps_cards_do_not_count_toward_a_slice_of_several():
    mps = [GPU(i, f"GPU-{i}", "H100", 80 * GiB, True, "mps") for i in range(2)]
    assert Allocator(mps).most_cards() == 0
    assert Allocator([*mps, GPU(2, "GPU-2", "H100", 80 * GiB, True)]).most_cards() == 1
