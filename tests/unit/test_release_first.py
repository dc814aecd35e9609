"""A release before any pause (``ArbiterApp.release_first``): where the free blocks idle
kernels keep cached cover a cell's room, they are asked to give them back (``release``,
protocol version 5) and nobody is paused; where they would not, nobody is asked and the
pauses are made as without. Through the arbiter's own path (books, rooms, moves), with
the kernels' connections answering as kernels do and NVML's reading stood in by a model
of one card (``tests/unit/test_room_ahead.py``). What a kernel says it cached or gave
back decides only whom to ask: the room is read from the card. The kernel's side:
``tests/unit/test_arbiter_contracts.py`` (the figure and the message) and
``tests/gpu/test_release_gpu.py`` (PyTorch's cache on a real card)."""

import asyncio
import time

import pytest

from jupyter_vgpu.node import books
from jupyter_vgpu.node.arbiter import Arbiter
from jupyter_vgpu.slice import Slice

from .answering import Answering
from .sleepers import sleeping
from .test_room_ahead import CARD, CONTEXT, Card, card_arbiter, decided, joined, prefetch

GiB, MiB = 2**30, 2**20
#: The 12x MLP's figures (docs/design.md): a cell's kernel grows to about 17 GiB; one
#: idle after its cell holds 16.7 GiB, of which about 14 GiB are cached free blocks.
BUDGET = 20 * GiB
LIVE, CACHED = int(2.5 * GiB), 14 * GiB


class Kernel(Answering):
    """A kernel's connection that says hello in ``version``. A pause takes its bytes off
    the card model but for its context; a release gives back ``gives`` bytes of it (what
    it said it cached, unless the test makes it lie) and answers ``released`` with
    ``says`` (default: what it gave)."""

    def __init__(
        self, kernel: books.Kernel, card: Card, version: int, gives: int = 0, says: int | None = None
    ):
        super().__init__(kernel)
        self.card, self.hello, self.identity = card, {"version": version}, kernel.identity
        self.gives, self.says = gives, says

    async def ask(self, msg: dict, timeout: float, sent=None) -> dict:
        self.asked.append(msg["type"])
        if msg["type"] == "pause":
            self.card.held[self.pid] = CONTEXT
            return {"ok": True, "message": "done", "released": 0}
        if msg["type"] == "release":
            self.card.held[self.pid] -= self.gives
            self.kernel.resident = self.card.held[self.pid]  # as the arbiter's NVML read sets it
            said = self.gives if self.says is None else self.says
            return {"ok": True, "message": "done", "released": said}
        return {"ok": True, "message": "done", "released": 0}


@pytest.fixture
def processes():
    with sleeping(3) as pids:
        yield pids


def node(pids: list[int], release_first: bool = True, free: int = 4 * GiB, version: int = 5, **liar):
    """An arbiter and its kernels on an 80 GiB card, budgets of 20 GiB: ``pids[0]`` about
    to run a cell (idle, its 2.5 GiB back on the card), ``pids[1]`` idle a second after
    its cell (16.7 GiB, 14 GiB of them cached; its hello of ``version``; ``liar``: what its
    release gives and says, :class:`Kernel`), ``pids[2]`` idle for an hour (2.5 GiB,
    nothing cached); the card has ``free`` bytes free, the rest out of every kernel's
    reach. The cell is short by ``20 GiB - 2.5 GiB - free``."""
    held = {pids[0]: LIVE, pids[1]: LIVE + CACHED, pids[2]: LIVE}
    card = Card(80 * GiB, 0)
    card.held = dict(held)
    card.reserve = card.total - free - sum(held.values())
    # the host's own memory is not what these tests are about
    arbiter = card_arbiter(card, queue_timeout=10.0, release_first=release_first, host_memory_limit=1 << 40)
    now = time.monotonic()
    kernels = []
    for i, pid in enumerate(pids):
        kernel = joined(arbiter, pid, i, BUDGET, held[pid])
        kernel.cached = CACHED if i == 1 else 0
        kernel.pausable = LIVE  # what a pause of it would store (its hello says so)
        kernel.state, kernel.since = books.IDLE, now - (3600 if i == 2 else 1)
        gives = dict(gives=CACHED) | liar if i == 1 else {}
        arbiter.conns[pid] = Kernel(kernel, card, version if i == 1 else 5, **gives)
        kernels.append(kernel)
    return arbiter, card, kernels


def ask(arbiter: Arbiter, pid: int, rid: int = 1) -> list[dict]:
    """Request ``rid`` of the kernel ``pid`` for a cell, decided; what its connection was told."""
    conn = arbiter.conns[pid]
    asyncio.run(arbiter.rooms.room(conn, rid, "run"))
    return [m for m in conn.told if m.get("id") == rid]


def asked(arbiter: Arbiter, pid: int) -> list[str]:
    return arbiter.conns[pid].asked


def test_cached_blocks_that_cover_the_room_are_given_back_and_nobody_is_paused(processes):
    arbiter, card, kernels = node(processes)
    assert ask(arbiter, processes[0])[-1] == {"type": "grant", "id": 1}
    assert asked(arbiter, processes[1]) == ["release"]
    assert asked(arbiter, processes[2]) == []  # idle the longest, but holding nothing cached
    assert decided(arbiter, "pause") == decided(arbiter, "suspend") == []
    (release,) = decided(arbiter, "release")
    assert release["server"] == "user1/"
    assert release["released"] == CACHED
    assert "user0/" in release["reason"]
    # it stays on the card, idle, its live bytes with it: its next cell needs no resume
    assert kernels[1].state == books.IDLE
    assert card.held[processes[1]] == LIVE
    assert arbiter.metrics.releases.labels(gpu=CARD)._value.get() == 1


def test_without_release_first_the_same_room_is_made_by_a_pause(processes):
    arbiter, _, kernels = node(processes, release_first=False)
    assert ask(arbiter, processes[0])[-1] == {"type": "grant", "id": 1}
    assert "release" not in asked(arbiter, processes[1]) + asked(arbiter, processes[2])
    assert decided(arbiter, "release") == []
    assert decided(arbiter, "pause")  # the longest idle first, then the one with the cache
    assert kernels[1].state == books.PAUSED


def test_caches_that_would_not_cover_the_room_are_not_asked_for(processes):
    # free 2 GiB: 15.5 GiB short, 14 GiB cached: the pauses are needed whatever is released
    arbiter, _, kernels = node(processes, free=2 * GiB)
    assert ask(arbiter, processes[0])[-1] == {"type": "grant", "id": 1}
    assert decided(arbiter, "release") == []
    assert "release" not in asked(arbiter, processes[1])
    assert kernels[1].state == books.PAUSED


def test_a_kernel_that_says_it_gave_back_what_it_kept_is_paused_for_the_room_all_the_same(processes):
    # it says 14 GiB cached and released; it gives nothing: the card is read, not its word
    arbiter, card, kernels = node(processes, gives=0, says=CACHED)
    assert ask(arbiter, processes[0])[-1] == {"type": "grant", "id": 1}
    assert asked(arbiter, processes[1]) == ["release", "pause"]  # asked to release once only
    assert kernels[1].state == books.PAUSED
    assert card.held[processes[1]] == CONTEXT


def test_a_kernel_of_an_older_version_is_never_asked_to_release(processes):
    # a kernel of version 4 knows no release: its figure, however it came, asks nothing
    arbiter, _, kernels = node(processes, version=4)
    assert ask(arbiter, processes[0])[-1] == {"type": "grant", "id": 1}
    assert "release" not in asked(arbiter, processes[1])
    assert decided(arbiter, "release") == []
    assert kernels[1].state == books.PAUSED


def away(arbiter: Arbiter, card: Card, kernel: books.Kernel) -> None:
    """``kernel`` paused: its live bytes off the card, its context on it."""
    kernel.state, kernel.paused_bytes = books.PAUSED, LIVE
    card.held[kernel.pid] = kernel.resident = CONTEXT


@pytest.mark.parametrize("release_first", [True, False])
def test_a_prefetch_has_the_caches_of_kernels_that_ran_a_moment_ago_given_back_for_its_cell(
    processes, release_first
):
    # user0 edits a paused kernel's cell; user1's cell ended a second ago: the room ahead
    # pauses nobody within their idle_seconds, but a release takes nobody off the card
    arbiter, card, kernels = node(processes, release_first, free=6 * GiB)
    away(arbiter, card, kernels[0])
    conn = arbiter.conns[processes[0]]
    prefetch(arbiter, conn, 1)
    assert {"type": "grant", "id": 1} in conn.told
    released = decided(arbiter, "release")
    assert kernels[1].state == books.IDLE  # never paused for a cell that has not started
    if release_first:
        assert [d["reason"] for d in released] == ["room ahead for user0/"]
        assert card.held[processes[1]] == LIVE
        assert decided(arbiter, "pause") == decided(arbiter, "suspend") == []  # the caches covered it
    else:
        assert released == []
        assert card.held[processes[1]] == LIVE + CACHED


def test_releasable_bytes_are_an_idle_kernels_cache_never_past_what_it_holds():
    server = books.Server(1, "ada", "", Slice(CARD, 0, "H100", 80 * GiB, BUDGET, 50))
    kernel = books.Kernel(1, server, resident=3 * GiB, cached=5 * GiB)
    assert books.releasable(kernel, CARD) == 3 * GiB  # it cannot give back more than it holds
    kernel.cached = GiB
    assert books.releasable(kernel, CARD) == GiB
    for state in (books.ACTIVE, books.PAUSED, books.SUSPENDED):
        kernel.state = state
        assert books.releasable(kernel, CARD) == 0
    kernel.state = books.IDLE
    with kernel.move("pause"):
        assert books.releasable(kernel, CARD) == 0


def test_releases_are_asked_in_the_victims_order_up_to_the_first_that_covers_the_room():
    server = books.Server(1, "ada", "", Slice(CARD, 0, "H100", 80 * GiB, BUDGET, 50))
    a, b, c, d = (
        books.Kernel(i, server, resident=10 * GiB, cached=n * GiB) for i, n in enumerate((0, 3, 4, 5))
    )
    order = [(a, "pause"), (b, "pause"), (c, "pause"), (d, "suspend")]
    assert books.releases(order, 6 * GiB, CARD) == [b, c]  # a has nothing cached
    assert books.releases(order, 7 * GiB, CARD) == [b, c]
    assert books.releases(order, 8 * GiB, CARD) == []  # d is to be suspended: not idle
    assert books.releases(order, 0, CARD) == []  # nothing short: nobody
