"""The arbiter's watchdog per card, without a driver: ada's server is on GPU-0 and bob's
on GPU-1; a child of ada's (a real process) shows up on GPU-1, under ada's budget. The
arbiter reads each card (here a stand-in for NVML's per-process figures, the one thing
this machine lacks), warns at once with the card named, tells ada's kernels, and under
``kill`` ends the child: a real process, really ended. Bob's and ada's own processes
stay. The same path on two real cards is ``tests/gpu/test_two_gpus.py``."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from jupyter_vgpu.node.app import ArbiterApp
from jupyter_vgpu.node.arbiter import Arbiter
from jupyter_vgpu.node.cards import Reading
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.waiting import wait_for

GiB = 2**30
PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def processes():
    """ada's server process with a child of its own, and bob's server process."""
    ada = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(ada.stdout.readline())
    bob = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield ada.pid, child, bob.pid
    for p in (ada, bob):
        p.kill()
        p.wait()


def test_a_child_on_the_other_card_is_warned_with_the_card_named_then_ended(processes):
    ada, child, bob = processes
    arbiter = Arbiter(ArbiterApp(registrars="none", over_budget="kill", grace_seconds=1.0))
    for pid, user, uuid in ((ada, "ada", "GPU-0"), (bob, "bob", "GPU-1")):
        arbiter.register(pid, user, "", Slice(uuid, int(uuid[-1]), "H100", 80 * GiB, 8 * GiB, 50))
    held = {"GPU-0": {ada: GiB}, "GPU-1": {bob: GiB, child: GiB}}

    async def read(uuid: str) -> Reading:
        processes = {pid: used for pid, used in held.get(uuid, {}).items() if _alive(pid)}
        return Reading(80 * GiB, sum(processes.values()), processes)

    arbiter.read = read

    def decided(what: str) -> list[dict]:
        return [d for d in arbiter.decisions if d["what"] == what]

    asyncio.run(arbiter.enforce(0.0))
    [warned] = decided("wrong GPU: warn")
    assert (warned["pid"], warned["server"], warned["used"]) == (child, "ada/", GiB)
    assert warned["gpus"] == ["GPU-1"]
    assert warned["mapped_by"] == "tree"
    assert "outside its vGPU slice (1.00 GiB on GPU-1)" in warned["message"]
    assert not decided("over budget: warn"), "2 GiB of an 8 GiB budget"
    asyncio.run(arbiter.enforce(0.5))
    assert not decided("wrong GPU: kill"), "within the grace period"
    asyncio.run(arbiter.enforce(1.0))
    assert [d["pid"] for d in decided("wrong GPU: kill")] == [child]
    wait_for(lambda: not _alive(child), 10, "the child on the other card to end")
    assert _alive(ada)
    assert _alive(bob)
    asyncio.run(arbiter.enforce(2.0))  # gone from the card: nothing more to say
    assert len(decided("wrong GPU: warn")) == 1


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_process_of_no_server_is_named_by_the_card_it_holds_most_on(processes):
    ada, _, bob = processes
    arbiter = Arbiter(ArbiterApp(registrars="none", unowned_policy="report"))
    for pid, uuid in ((ada, "GPU-0"), (bob, "GPU-1")):
        arbiter.register(pid, uuid, "", Slice(uuid, int(uuid[-1]), "H100", 80 * GiB, 8 * GiB, 50))
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # most on the last card read, less on the first, least on the middle one: the card
        # is the largest figure, not one compared with the sum of the cards before it
        held = {"GPU-0": {stray.pid: 5 * GiB}, "GPU-1": {stray.pid: GiB}, "GPU-2": {stray.pid: 11 * GiB // 2}}

        async def read(uuid: str) -> Reading:
            return Reading(80 * GiB, sum(held[uuid].values()), held[uuid])

        async def managed() -> set[str]:
            return set(held)

        arbiter.read = read
        arbiter.enforcement.managed_cards = managed
        asyncio.run(arbiter.enforce(0.0))
        [reported] = [d for d in arbiter.decisions if d["what"].startswith("unowned")]
        assert (reported["pid"], reported["gpu"]) == (stray.pid, "GPU-2")
    finally:
        stray.kill()
        stray.wait()
