"""The budgets' watchdog decides on per-process figures (as NVML gives them): a warning
the moment a process of a server is over, the admin's policy once the grace period has
passed, nothing for processes under budget or of no registered server."""

import pytest

from jupyter_vgpu.node.books import Server
from jupyter_vgpu.node.watchdog import Watchdog, owners
from jupyter_vgpu.slice import Slice

GiB = 2**30
SLICE = Slice("GPU-0", 0, "H100", 80 * GiB, 2 * GiB, 50)
TREE = {100: 100, 101: 100, 102: 100, 200: 200}  # pid -> registered root (101, 102: children of 100)


def owner():
    return owners([Server(100, "ada", "", SLICE), Server(200, "bob", "", SLICE)], TREE.get)


@pytest.mark.parametrize("policy", ["report", "pause", "kill"])
def test_a_process_over_budget_is_warned_then_the_policy_applies(policy):
    dog = Watchdog(policy, grace_seconds=5, remind_seconds=60)
    usage = {100: GiB, 101: 3 * GiB, 200: GiB, 999: 70 * GiB}  # 101: ada's subprocess; 999: not ours
    first = dog.step(0.0, usage, owner())
    assert [(a.kind, a.pid, a.server) for a in first] == [("warn", 101, "ada/")]
    assert "3.00 GiB on the GPU, budget 2.00 GiB" in first[0].message()
    assert dog.step(4.9, usage, owner()) == []
    late = dog.step(5.0, usage, owner())
    assert [(a.kind, a.pid) for a in late] == [(policy, 101)]
    assert dog.step(6.0, usage, owner()) == []  # applied once (report repeats after remind_seconds)
    if policy == "report":
        assert [a.kind for a in dog.step(65.0, usage, owner())] == ["report"]


def test_back_under_budget_starts_the_grace_period_again():
    dog = Watchdog("kill", grace_seconds=5)
    assert dog.step(0.0, {102: 3 * GiB}, owner())
    assert dog.step(3.0, {102: GiB}, owner()) == []
    assert [a.kind for a in dog.step(4.0, {102: 3 * GiB}, owner())] == ["warn"]
    assert dog.step(8.0, {102: 3 * GiB}, owner()) == []
    assert [a.kind for a in dog.step(9.0, {102: 3 * GiB}, owner())] == ["kill"]


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="report, pause, kill"):
        Watchdog("ignore")
