"""Placement: binpack, spread, overcommit, refusal, resize."""

import pytest

from hub_spawner.inventory import GPU
from hub_spawner.placement import Allocator, Placement, PlacementError

GiB = 2**30


def gpus(n=2, memory=80 * GiB):
    return [GPU(i, f"GPU-{i}", "H100", memory, simulated=True) for i in range(n)]


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
    a = Allocator(gpus(1), overcommit_ratio=1.5)
    for i in range(3):
        a.place(f"u{i}/", 40 * GiB, 100)
    assert a.committed(a.gpus[0]) == 120 * GiB
    with pytest.raises(PlacementError):
        a.place("u3/", 1, 100)
    assert Allocator(gpus(1)).largest_budget() == 80 * GiB
    assert a.largest_budget() == 120 * GiB


def test_refusal_names_every_gpu_and_the_request():
    a = Allocator(gpus(2))
    a.place("a/", 70 * GiB, 100)
    a.place("b/", 75 * GiB, 100)
    with pytest.raises(PlacementError) as e:
        a.place("c/", 40 * GiB, 100)
    message = str(e.value)
    assert "40.00 GiB" in message
    assert "GPU 0 (H100) has 10.00 GiB left" in message
    assert "GPU 1 (H100) has 5.00 GiB left" in message
    assert e.value.jupyterhub_message == message
    assert "c/" not in a.placements


def test_replacing_a_key_does_not_count_it_twice():
    a = Allocator(gpus(1))
    a.place("a/", 60 * GiB, 100)
    a.place("a/", 70 * GiB, 100)  # a restart of the same server
    assert a.committed(a.gpus[0]) == 70 * GiB


def test_resize_checks_the_gpu_and_changes_nothing_on_refusal():
    a = Allocator(gpus(1))
    a.place("a/", 40 * GiB, 50)
    a.place("b/", 30 * GiB, 50)
    a.resize("a/", 50 * GiB, 20)
    assert a.placements["a/"] == Placement("a/", "GPU-0", 50 * GiB, 20)
    with pytest.raises(PlacementError, match="cannot grow a/"):
        a.resize("a/", 60 * GiB, 20)
    assert a.placements["a/"].memory_limit == 50 * GiB
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
    with pytest.raises(ValueError, match="at least one GPU"):
        Allocator([])
