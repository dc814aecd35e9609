"""The arbiter's background look (``Arbiter.tick``) decides its pauses under the card's
lock and makes them outside it: a cell that starts meanwhile is decided at once, and a
cell that starts stops the moves not yet begun. Through the arbiter's own path with NVML
stood in by a model of one card (``tests/unit/test_room_ahead.py``): ``pids[5]`` is idle
past its ``idle_seconds`` on a card above the watermark, ``pids[6]`` about to run a cell
that fits beside it."""

import asyncio

import pytest

from jupyter_vgpu.node import books
from jupyter_vgpu.testing.waiting import wait_for_async

from .answering import Answering
from .sleepers import sleeping
from .test_room_ahead import decided, node


class HeldPause(Answering):
    """A kernel's connection whose pause lasts until ``go`` is set."""

    def __init__(self, kernel: books.Kernel):
        super().__init__(kernel)
        self.go = asyncio.Event()
        self.pausing = False

    async def ask(self, msg: dict, timeout: float, sent=None) -> dict:
        if msg["type"] == "pause":
            self.pausing = True
            await self.go.wait()
        return await super().ask(msg, timeout, sent)


@pytest.fixture
def processes():
    with sleeping(7) as pids:
        yield pids


def above_the_watermark(pids: list[int]):
    arbiter, card, kernels = node(pids, short_contexts=0, idle_pid_seconds=400)
    arbiter.config.watermark = 0.01  # every card is above it: the idle kernel is due a pause
    return arbiter, card, kernels


def test_a_cell_is_decided_while_a_background_pause_is_under_way(processes):
    arbiter, _, kernels = above_the_watermark(processes)
    idle = arbiter.conns[processes[5]] = HeldPause(kernels[5])
    other = arbiter.conns[processes[6]]
    told_meanwhile = []

    async def go():
        tick = asyncio.ensure_future(arbiter.tick())
        await wait_for_async(lambda: idle.pausing, 10, "the background pause to begin")
        assert kernels[5].moving == "pause"  # no room takes it meanwhile
        await arbiter.rooms.request(other, 5, "run")
        await asyncio.wait_for(other.room_task, 5)  # under the lock, it waited for the pause
        told_meanwhile.extend(m for m in other.told if m.get("id") == 5)
        idle.go.set()
        await tick

    asyncio.run(go())
    assert told_meanwhile == [{"type": "grant", "id": 5}]
    [pause] = decided(arbiter, "pause")
    assert (pause["server"], pause["reason"]) == ("user5/", "idle")
    assert kernels[5].moving is None


def test_a_cell_that_starts_stops_the_background_moves_not_yet_begun(processes):
    arbiter, _, kernels = above_the_watermark(processes)
    kernels[6].since -= 400  # idle past its idle_seconds too: two pauses due, user5's first
    first = arbiter.conns[processes[5]] = HeldPause(kernels[5])

    async def go():
        tick = asyncio.ensure_future(arbiter.tick())
        await wait_for_async(lambda: first.pausing, 10, "the first background pause to begin")
        assert [k.moving for k in kernels[5:]] == ["pause", "pause"]
        kernels[0].state = books.ACTIVE  # a cell starts on the card
        first.go.set()
        await tick

    asyncio.run(go())
    assert [d["server"] for d in decided(arbiter, "pause")] == ["user5/"]
    assert kernels[6].state == books.IDLE
    assert kernels[6].moving is None, "the move not made leaves no mark behind"
