"""The budgets' watchdog decides on each server's sum over its processes (NVML gives
per-process figures): a warning the moment a server is over, naming each process, the
admin's policy once the grace period has passed, nothing for servers under budget; and,
by default deny, a warning then the unowned policy for processes of no server that the
allowlist does not name; and for a server's process holding memory on a card outside
its slice (a user who cleared ``CUDA_VISIBLE_DEVICES``), a warning whatever its bytes,
then the policy for the processes on the other card."""

import dataclasses

import pytest

from jupyter_vgpu.node.books import Server
from jupyter_vgpu.node.watchdog import Watchdog, owners
from jupyter_vgpu.slice import Card, Slice

GiB = 2**30
SLICE = Slice("GPU-0", 0, "H100", 80 * GiB, 2 * GiB, 50)
# pid -> (server key, how it was mapped): 101, 102 are ada's (102 a daemon found by cgroup)
MAPPING = {100: (100, "tree"), 101: (100, "tree"), 102: (100, "cgroup"), 200: (200, "tree")}


def owner():
    return owners([Server(100, "ada", "", SLICE), Server(200, "bob", "", SLICE)], MAPPING.get)


@pytest.mark.parametrize("policy", ["report", "pause", "kill"])
def test_a_server_over_budget_is_warned_then_the_policy_applies(policy):
    dog = Watchdog(policy, grace_seconds=5, remind_seconds=60)
    usage = {100: GiB, 101: 3 * GiB, 200: GiB, 999: 70 * GiB}  # 101: ada's subprocess; 999: not ours
    first = dog.step(0.0, usage, owner())
    assert [(a.kind, a.pid, a.server, a.total) for a in first] == [("warn", 101, "ada/", 4 * GiB)]
    message = first[0].message()
    assert "4.00 GiB on the GPU for the server, budget 2.00 GiB" in message
    assert "process 101: 3.00 GiB, process 100: 1.00 GiB" in message
    assert dog.step(4.9, usage, owner()) == []
    late = dog.step(5.0, usage, owner())
    # kill: the largest until the rest fits (4 GiB - 3 GiB <= 2 GiB); pause: every process (its kernels)
    expected = {"report": [101], "pause": [101, 100], "kill": [101]}[policy]
    assert [(a.kind, a.pid) for a in late] == [(policy, pid) for pid in expected]
    if policy == "kill":  # ended at every look while the server is over
        assert [(a.kind, a.pid) for a in dog.step(6.0, usage, owner())] == [("kill", 101)]
        return
    assert dog.step(6.0, usage, owner()) == []  # applied once, then reminders
    assert [a.kind for a in dog.step(65.0, usage, owner())] == [policy] * len(expected)


def test_processes_each_under_budget_count_together():
    """Three processes of 1.5 GiB against 2 GiB: each under, the server over."""
    dog = Watchdog("kill", grace_seconds=1)
    usage = {100: GiB + GiB // 2, 101: GiB + GiB // 2, 102: GiB + GiB // 2}
    assert [(a.kind, a.mapped_by) for a in dog.step(0.0, usage, owner())] == [("warn", "tree")]
    killed = dog.step(1.0, usage, owner())
    # largest first (ties in reading order) until the rest fits: 4.5 -> 3.0 -> 1.5 GiB
    assert [(a.kind, a.pid) for a in killed] == [("kill", 100), ("kill", 101)]
    assert dog.step(2.0, {102: GiB + GiB // 2}, owner()) == []


def test_the_largest_process_is_ended_first_and_only_as_many_as_needed():
    dog = Watchdog("kill", grace_seconds=0.5)
    usage = {100: GiB // 2, 102: 4 * GiB}  # the kernel's context, and its escaped daemon
    warn = dog.step(0.0, usage, owner())
    assert [(a.kind, a.pid, a.mapped_by) for a in warn] == [("warn", 102, "cgroup")]
    assert [(a.kind, a.pid) for a in dog.step(0.5, usage, owner())] == [("kill", 102)]


def test_back_under_budget_starts_the_grace_period_again():
    dog = Watchdog("kill", grace_seconds=5)
    assert dog.step(0.0, {102: 3 * GiB}, owner())
    assert dog.step(3.0, {102: GiB}, owner()) == []
    assert [a.kind for a in dog.step(4.0, {102: 3 * GiB}, owner())] == ["warn"]
    assert dog.step(8.0, {102: 3 * GiB}, owner()) == []
    assert [a.kind for a in dog.step(9.0, {102: 3 * GiB}, owner())] == ["kill"]


@pytest.mark.parametrize("policy", ["report", "kill"])
def test_default_deny_a_process_of_no_server_is_reported_then_the_unowned_policy_applies(policy):
    dog = Watchdog("report", grace_seconds=2, unowned_policy=policy)
    allowlist = {500}.__contains__  # e.g. an MPS daemon
    usage = {100: GiB, 999: 3 * GiB, 500: GiB}
    first = dog.step(0.0, usage, owner(), allowlist)
    assert [(a.kind, a.pid, a.server, a.mapped_by, a.budget) for a in first] == [
        ("warn", 999, "", "unowned", None)
    ]
    assert (
        first[0].message() == "process 999 on a managed GPU belongs to no vGPU server (3.00 GiB on the GPU)"
    )
    assert dog.step(1.0, usage, owner(), allowlist) == []
    assert [(a.kind, a.pid) for a in dog.step(2.0, usage, owner(), allowlist)] == [(policy, 999)]
    assert dog.step(10.0, {100: GiB}, owner(), allowlist) == []  # gone: forgotten
    assert [a.kind for a in dog.step(11.0, usage, owner(), allowlist)] == ["warn"]


def test_without_an_allowlist_processes_of_no_server_are_left_alone():
    assert Watchdog("kill", grace_seconds=0).step(0.0, {999: 70 * GiB}, owner()) == []


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="report, pause, kill"):
        Watchdog("ignore")
    with pytest.raises(ValueError, match="report, kill"):
        Watchdog("report", unowned_policy="pause")


def by_card(**pids: dict[str, int]) -> tuple[dict[int, int], dict[int, dict[str, int]]]:
    """``processes`` and ``cards`` of one reading, from ``p101={"GPU-0": ..., "GPU-1": ...}``."""
    cards = {int(k[1:]): v for k, v in pids.items()}
    return {pid: sum(v.values()) for pid, v in cards.items()}, cards


@pytest.mark.parametrize("policy", ["report", "pause", "kill"])
def test_a_process_on_a_card_outside_its_slice_is_warned_at_once_then_the_policy_applies(policy):
    dog = Watchdog(policy, grace_seconds=1, remind_seconds=60)
    # ada's kernel 100 on its card; its child 101 took 1 GiB of GPU-1 (well under the budget
    # of 2 GiB); bob's kernel 200 on GPU-0 too: only ada's 101 is on the wrong card
    usage, cards = by_card(p100={"GPU-0": GiB // 2}, p101={"GPU-1": GiB}, p200={"GPU-0": GiB})
    first = dog.step(0.0, usage, owner(), cards=cards)
    assert [(a.kind, a.pid, a.server, a.elsewhere) for a in first] == [
        ("warn", 101, "ada/", (("GPU-1", GiB),))
    ]
    assert first[0].wrong_gpu
    assert not first[0].unowned
    assert first[0].message() == "process 101 of ada/ uses a GPU outside its vGPU slice (1.00 GiB on GPU-1)"
    assert dog.step(0.5, usage, owner(), cards=cards) == []
    late = dog.step(1.0, usage, owner(), cards=cards)
    assert [(a.kind, a.pid, a.used) for a in late] == [(policy, 101, GiB)]
    assert "outside its vGPU slice" in late[0].message()
    assert dog.step(2.0, {100: GiB // 2}, owner(), cards={100: {"GPU-0": GiB // 2}}) == []  # gone: forgotten
    assert [a.kind for a in dog.step(3.0, usage, owner(), cards=cards)] == ["warn"]


def test_a_kernel_on_both_cards_and_over_budget_gets_both_warnings():
    dog = Watchdog("kill", grace_seconds=1)
    usage, cards = by_card(p100={"GPU-0": GiB, "GPU-1": 2 * GiB})
    first = dog.step(0.0, usage, owner(), cards=cards)
    assert sorted((a.kind, a.wrong_gpu, a.used) for a in first) == [
        ("warn", False, 3 * GiB),
        ("warn", True, 2 * GiB),
    ]
    assert sorted((a.kind, a.wrong_gpu) for a in dog.step(1.0, usage, owner(), cards=cards)) == [
        ("kill", False),
        ("kill", True),
    ]


def test_a_simulated_slice_has_no_card_to_be_off():
    simulated = dataclasses.replace(SLICE, simulated=True)
    owner_ = owners([Server(100, "ada", "", simulated)], MAPPING.get)
    usage, cards = by_card(p100={"GPU-sim-0": GiB // 2, "GPU-1": GiB // 2})
    assert Watchdog("kill", grace_seconds=0).step(0.0, usage, owner_, cards=cards) == []


def test_a_card_the_slice_does_not_pick_or_this_look_did_not_read_is_no_card_to_be_off():
    """A Slurm job's or a pod's card is the scheduler's choice (the slice follows once the
    Hub reads where it landed), and a placeholder id of a card not yet reported is none
    NVML knows: neither makes a process of the server on a real card 'wrong'."""
    usage, cards = by_card(p300={"GPU-1": GiB}, p400={"GPU-1": GiB}, p500={"GPU-1": GiB})
    servers = [
        Server("job:42", "ada", "", SLICE),  # Slurm put the job on GPU-1
        Server("pod:0b7e", "bob", "", SLICE),
        Server(500, "cy", "", dataclasses.replace(SLICE, gpu_uuid="node-3/gpu-0")),
    ]
    mapping = {300: ("job:42", "job"), 400: ("pod:0b7e", "pod"), 500: (500, "tree")}.get
    owner_ = owners(servers, mapping, cards=["GPU-0", "GPU-1"])
    assert Watchdog("kill", grace_seconds=0).step(0.0, usage, owner_, cards=cards) == []
    # the same servers keyed by a process tree on a card that was read: wrong
    tree = owners([Server(300, "ada", "", SLICE)], {300: (300, "tree")}.get, cards=["GPU-0", "GPU-1"])
    assert [a.kind for a in Watchdog("kill", grace_seconds=0).step(0.0, usage, tree, cards=cards)] == ["warn"]


def test_a_slice_of_two_cards_holds_its_budget_on_each_and_both_are_its_own():
    pair = dataclasses.replace(SLICE, more_gpus=(Card("GPU-1", 1, 80 * GiB),))
    owner_ = owners([Server(100, "ada", "", pair)], MAPPING.get, cards=["GPU-0", "GPU-1", "GPU-2"])
    dog = Watchdog("kill", grace_seconds=0)
    # 1.5 GiB on each card: 3 GiB in all, within the 2 GiB budget of each card
    usage, cards = by_card(p100={"GPU-0": 3 * GiB // 2, "GPU-1": 3 * GiB // 2})
    assert dog.step(0.0, usage, owner_, cards=cards) == []
    # 3 GiB on GPU-1 alone is over that card's budget: the process holding it is named
    usage, cards = by_card(p100={"GPU-0": GiB // 2}, p101={"GPU-1": 3 * GiB})
    over = dog.step(1.0, usage, owner_, cards=cards)
    assert [(a.kind, a.pid, a.used, a.total, a.wrong_gpu) for a in over] == [
        ("warn", 101, 3 * GiB, 3 * GiB, False)
    ]
    # a third card is not the slice's
    usage, cards = by_card(p100={"GPU-0": GiB // 2, "GPU-2": GiB // 2})
    wrong = Watchdog("kill", grace_seconds=0).step(0.0, usage, owner_, cards=cards)
    assert [(a.kind, a.elsewhere) for a in wrong] == [("warn", (("GPU-2", GiB // 2),))]
