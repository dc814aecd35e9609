"""The pauses metric is labelled with why the kernel was paused (:class:`books.Reason`).

The label once came from ``reason.startswith("room")``: every other pause counted as
``idle``, the watchdog's too. Here the watchdog pauses a kernel over its budget and
one on the wrong GPU, through the arbiter's own path (reading, watchdog, action, pause
asked of the kernel), and the metric must say so; a kernel stands in for itself (it
answers the pause) and NVML's reading is given."""

import asyncio
import os
import subprocess
import sys

import pytest

from jupyter_vgpu.host import procs
from jupyter_vgpu.node import books
from jupyter_vgpu.node.app import ArbiterApp
from jupyter_vgpu.node.arbiter import Arbiter
from jupyter_vgpu.node.books import Reason
from jupyter_vgpu.node.cards import Reading
from jupyter_vgpu.slice import Slice

from .answering import Answering

GiB = 2**30


@pytest.fixture
def kernel_process():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process.pid
    process.kill()
    process.wait()


def pauses(arbiter: Arbiter, reason: str) -> float:
    value = arbiter.metrics.registry.get_sample_value(
        "jupyter_vgpu_pauses_total", {"gpu": "GPU-0", "reason": reason}
    )
    return value or 0.0


def watched(kernel_pid: int, held: dict[str, int]) -> tuple[Arbiter, books.Kernel, Answering]:
    """An arbiter whose watchdog pauses after a 1 s grace, with one idle kernel of ada's
    (a slice of 8 GiB on GPU-0) holding ``held`` bytes per card."""
    config = ArbiterApp(registrars="none", over_budget="pause", grace_seconds=1.0, host_reserve=1)
    arbiter = Arbiter(config)
    server = arbiter.register(kernel_pid, "ada", "", Slice("GPU-0", 0, "H100", 80 * GiB, 8 * GiB, 50))
    kernel = books.Kernel(kernel_pid, server, "k", uid=os.getuid(), identity=procs.Identity.of(kernel_pid))
    kernel.state = books.IDLE
    conn = Answering(kernel)
    arbiter.conns[kernel_pid] = conn

    async def read(uuid: str) -> Reading:
        used = held.get(uuid, 0)
        return Reading(80 * GiB, used, {kernel_pid: used} if used else {})

    async def managed() -> set[str]:
        return {"GPU-0", "GPU-1"}

    arbiter.read = read
    arbiter.enforcement.managed_cards = managed
    return arbiter, kernel, conn


@pytest.mark.parametrize(
    ("held", "reason"),
    [
        ({"GPU-0": 9 * GiB}, Reason.OVER_BUDGET),
        ({"GPU-0": 1 * GiB, "GPU-1": 1 * GiB}, Reason.WRONG_GPU),
    ],
)
def test_a_pause_by_the_watchdog_is_counted_under_its_own_reason(kernel_process, held, reason):
    arbiter, kernel, conn = watched(kernel_process, held)

    async def looks():
        await arbiter.enforce(0.0)  # warned
        await arbiter.enforce(1.5)  # still so after the grace period: paused

    asyncio.run(looks())
    assert conn.asked == ["pause"]
    assert kernel.state == books.PAUSED
    assert pauses(arbiter, reason.value) == 1
    assert pauses(arbiter, Reason.IDLE.value) == 0, "a watchdog pause counted as idle"
    [paused] = [d for d in arbiter.decisions if d["what"] == "pause"]
    assert paused["reason"] == reason.value


@pytest.mark.parametrize("reason", list(Reason))
def test_every_reason_is_its_own_label(kernel_process, reason):
    arbiter, kernel, _ = watched(kernel_process, {})
    assert asyncio.run(arbiter.moves.take_off(kernel, "pause", reason, for_whom="bob/"))
    assert {r: pauses(arbiter, r.value) for r in Reason} == {r: float(r is reason) for r in Reason}
    [paused] = [d for d in arbiter.decisions if d["what"] == "pause"]
    named = {Reason.ROOM: "room for bob/", Reason.AHEAD: "room ahead for bob/"}  # whom for
    assert paused["reason"] == named.get(reason, reason.value)
