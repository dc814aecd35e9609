"""A cell whose room would need paused kernels suspended waits for a cell running on its
card to end (``ArbiterApp.suspend_wait``), then suspends them if none has; the room made
ahead of a prefetched cell suspends nobody beside a running cell. Through the arbiter's
own path (its books, rooms and moves, the kernels' connections answering as kernels do),
with NVML's reading stood in by a model of one card (``tests/unit/test_room_ahead.py``):
``pids[0]`` is a paused kernel whose cell needs two more contexts' worth of the card,
``pids[1:5]`` paused kernels keeping a context each, ``pids[5]`` a kernel holding 3 GiB."""

import asyncio
import time

import pytest

from jupyter_vgpu.node import books
from jupyter_vgpu.testing.waiting import wait_for_async

from .sleepers import sleeping
from .test_grant_on_demand import Kernel as Pausing
from .test_room_ahead import decided, node, prefetch


@pytest.fixture
def processes():
    with sleeping(6) as pids:
        yield pids


def card_with_a_running_cell(pids: list[int], suspend_wait: float, granted: int = 3 * 2**30):
    """:func:`test_room_ahead.node` with ``suspend_wait`` and ``pids[5]`` running a cell
    (``granted`` its room; 0: it waits for its room itself)."""
    arbiter, card, kernels = node(pids, short_contexts=2)
    arbiter.config.suspend_wait = suspend_wait
    arbiter.config.queue_timeout = 60.0
    arbiter.conns[pids[5]] = Pausing(kernels[5], card, 4)  # its pause leaves its context alone
    kernels[5].state, kernels[5].granted = books.ACTIVE, granted
    return arbiter, card, kernels


async def asked_until(arbiter, pid: int, rid: int, condition, what: str):
    """Request ``rid`` of kernel ``pid`` as a task, returned once ``condition(told)`` holds
    for what its connection was told about it (``what``: that, in words)."""
    conn = arbiter.conns[pid]
    task = asyncio.ensure_future(arbiter.rooms.room(conn, rid, "run"))

    def seen():
        told = [m for m in conn.told if m.get("id") == rid]
        assert not (task.done() and not condition(told)), told  # it ended otherwise
        return condition(told)

    await wait_for_async(seen, 10, what)
    return task


def waits(told: list[dict]) -> bool:
    return any(m["type"] == "wait" for m in told)


def granted(told: list[dict]) -> bool:
    return any(m["type"] == "grant" for m in told)


def test_a_cell_waits_for_the_running_cell_and_pauses_its_kernel_once_it_ends(processes):
    arbiter, _, kernels = card_with_a_running_cell(processes, suspend_wait=30.0)

    async def go():
        task = await asked_until(arbiter, processes[0], 1, waits, "the cell told it waits")
        assert decided(arbiter, "suspend") == [], "nobody suspended while the other cell runs"
        kernels[5].state, kernels[5].granted = books.IDLE, 0  # its cell ends, as its report says
        await arbiter.notify()
        await asyncio.wait_for(task, 10)

    asyncio.run(go())
    told = [m for m in arbiter.conns[processes[0]].told if m.get("id") == 1]
    assert told[-1] == {"type": "grant", "id": 1}
    assert "waiting for one of the 1 running cell(s) to end (up to 30 s)" in told[0]["message"], told
    assert "needed" not in told[0]["message"], told
    assert decided(arbiter, "suspend") == []
    assert [d["server"] for d in decided(arbiter, "pause")] == ["user5/"]
    [queued] = decided(arbiter, "queued")
    assert "running cell(s) to end" in queued["message"], queued


def test_a_cell_suspends_once_its_wait_is_over_and_the_other_cell_still_runs(processes):
    arbiter, _, kernels = card_with_a_running_cell(processes, suspend_wait=0.3)
    t0 = time.monotonic()

    async def go():
        task = await asked_until(arbiter, processes[0], 1, granted, "the cell granted its room")
        await task

    asyncio.run(go())
    suspends = decided(arbiter, "suspend")
    assert len(suspends) == 2, suspends  # two contexts short: two paused kernels
    assert {d["reason"] for d in suspends} == {"room for user0/"}
    assert time.monotonic() - t0 >= 0.3
    assert kernels[5].state == books.ACTIVE, "the running cell was left alone"


def test_with_no_cell_running_the_suspends_are_made_at_once(processes):
    # pids[5] reports a cell but waits for its own room: it runs nothing yet
    arbiter, _, _ = card_with_a_running_cell(processes, suspend_wait=30.0, granted=0)

    async def go():
        task = await asked_until(arbiter, processes[0], 1, granted, "the cell granted its room")
        await task

    t0 = time.monotonic()
    asyncio.run(go())
    assert time.monotonic() - t0 < 5
    assert len(decided(arbiter, "suspend")) == 2
    assert decided(arbiter, "queued") == []


def test_without_the_setting_the_suspends_are_made_beside_the_running_cell(processes):
    arbiter, _, _ = card_with_a_running_cell(processes, suspend_wait=0.0)

    async def go():
        task = await asked_until(arbiter, processes[0], 1, granted, "the cell granted its room")
        await task

    asyncio.run(go())
    assert len(decided(arbiter, "suspend")) == 2
    assert decided(arbiter, "queued") == []


def test_a_room_ahead_suspends_nobody_beside_a_running_cell(processes):
    arbiter, _, kernels = card_with_a_running_cell(processes, suspend_wait=30.0)
    grower = arbiter.conns[processes[0]]
    prefetch(arbiter, grower, 7)
    assert grower.told[0] == {"type": "grant", "id": 7}  # it comes back; its cell makes the rest
    assert decided(arbiter, "suspend") == []
    kernels[5].state, kernels[5].granted = books.IDLE, 0  # the card quiet, a later prefetch may
    arbiter.rooms._prefetched.clear()
    kernels[0].state = books.PAUSED
    prefetch(arbiter, grower, 8)
    assert grower.told[-1] == {"type": "grant", "id": 8}
    assert decided(arbiter, "suspend"), "with no cell running, the room ahead suspends as before"


def test_the_setting_is_never_negative():
    from traitlets import TraitError

    from jupyter_vgpu.node.app import ArbiterApp

    with pytest.raises(TraitError):
        ArbiterApp(suspend_wait=-1.0)
