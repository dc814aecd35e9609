"""Growth granted on demand (``ArbiterApp.grant_on_demand``): a starting cell is granted what
its kernel holds and brings back plus a margin, admitted only where the running cells'
budgets fit the card, and the rest of its room is made when it grows (``room`` ``for:
grow``), through the arbiter's own path: its books, rooms and moves, the kernels'
connections answering as kernels do, with NVML's reading stood in by a model of one card
(``tests/unit/test_room_ahead.py``). The allocator's side, the ask before an allocation
fails: ``tests/unit/test_vmm_native.py``; the kernel's: ``tests/unit/test_arbiter_contracts.py``."""

import asyncio
import dataclasses
import time

import pytest

from jupyter_vgpu.host import procs
from jupyter_vgpu.node import books
from jupyter_vgpu.node.arbiter import Arbiter
from jupyter_vgpu.slice import Slice

from .answering import Answering
from .sleepers import sleeping
from .test_room_ahead import CARD, CONTEXT, Card, card_arbiter, decided, joined

GiB, MiB = 2**30, 2**20
BUDGET = 8 * GiB


class Kernel(Answering):
    """A kernel's connection that says hello in ``version``; a pause takes its bytes off the
    card model but for its context."""

    def __init__(self, kernel: books.Kernel, card: Card, version: int):
        super().__init__(kernel)
        self.card, self.hello, self.identity = card, {"version": version}, kernel.identity

    async def ask(self, msg: dict, timeout: float, sent=None) -> dict:
        if msg["type"] == "pause":
            self.card.held[self.pid] = CONTEXT
        return await super().ask(msg, timeout, sent)


@pytest.fixture
def processes():
    with sleeping(4) as pids:
        yield pids


def node(pids: list[int], on_demand: bool = True, version: int = 4, free: int = 3 * GiB):
    """An arbiter and its kernels on an 80 GiB card, budgets of 8 GiB: ``pids[0]`` about to
    run a cell (idle, 1 GiB on the card, its hello of ``version``), ``pids[1]`` idle for an
    hour holding 6 GiB, ``pids[2:]`` idle a moment ago, 2 GiB each; the card has ``free``
    bytes free, the rest out of every kernel's reach."""
    held = {pids[0]: GiB, pids[1]: 6 * GiB} | {pid: 2 * GiB for pid in pids[2:]}
    card = Card(80 * GiB, 0)
    card.held = held
    card.reserve = card.total - free - sum(held.values())
    arbiter = card_arbiter(card, grant_on_demand=on_demand)
    now = time.monotonic()
    kernels = []
    for i, pid in enumerate(pids):
        kernel = joined(arbiter, pid, i, BUDGET, held[pid])
        kernel.state, kernel.since = books.IDLE, now - (3600 if i == 1 else 1)
        arbiter.conns[pid] = Kernel(kernel, card, version if i == 0 else 4)
        kernels.append(kernel)
    return arbiter, card, kernels


def ask(arbiter: Arbiter, pid: int, rid: int, purpose: str = "run", nbytes: int = 0) -> list[dict]:
    """Request ``rid`` of the kernel ``pid`` decided; what its connection was told."""
    conn = arbiter.conns[pid]
    asyncio.run(arbiter.rooms.room(conn, rid, purpose, nbytes))
    return [m for m in conn.told if m.get("id") == rid]


def test_a_cell_starts_with_what_it_holds_and_the_margin_and_nobody_leaves_for_the_rest(processes):
    arbiter, _, kernels = node(processes)
    told = ask(arbiter, processes[0], 1)
    assert told[-1] == {"type": "grant", "id": 1}
    assert kernels[0].granted == GiB + arbiter.config.grant_margin  # held, nothing to bring back, margin
    assert decided(arbiter, "pause") == decided(arbiter, "suspend") == []
    assert kernels[1].state == books.IDLE


def test_with_grants_of_the_whole_budget_the_same_cell_takes_an_idle_kernel_off(processes):
    arbiter, _, kernels = node(processes, on_demand=False)
    assert ask(arbiter, processes[0], 1)[-1] == {"type": "grant", "id": 1}
    assert kernels[0].granted == BUDGET
    assert [d["server"] for d in decided(arbiter, "pause")] == ["user1/"]


def test_a_kernel_of_version_3_is_granted_its_whole_budget_on_demand_or_not(processes):
    arbiter, _, kernels = node(processes, version=3)
    assert ask(arbiter, processes[0], 1)[-1] == {"type": "grant", "id": 1}
    assert kernels[0].granted == BUDGET  # it cannot ask to grow: it gets all of it at once
    assert [d["server"] for d in decided(arbiter, "pause")] == ["user1/"]


def test_a_cell_that_grows_past_its_grant_gets_the_room_made_and_stays_running(processes):
    arbiter, card, kernels = node(processes)
    grower = kernels[0]
    ask(arbiter, processes[0], 1)
    since = grower.since
    card.held[processes[0]] = 2 * GiB  # it allocated within its grant
    told = ask(arbiter, processes[0], 2, "grow", 4 * GiB)
    assert told[-1] == {"type": "grant", "id": 2}
    # what it holds, the allocation that found no room and the margin
    assert grower.granted == 2 * GiB + 4 * GiB + arbiter.config.grant_margin
    assert [d["server"] for d in decided(arbiter, "pause")] == ["user1/"]
    [grown] = decided(arbiter, "grown")
    assert (grown["server"], grown["bytes"], grown["granted"]) == ("user0/", 4 * GiB, grower.granted)
    assert grower.state == books.ACTIVE  # its cell runs on, as it was
    assert grower.since == since
    waited = arbiter.metrics.registry.get_sample_value("jupyter_vgpu_grow_wait_seconds_count", {"gpu": CARD})
    assert waited == 1


def test_a_grant_never_shrinks_and_never_passes_the_budget(processes):
    arbiter, _, kernels = node(processes)
    grower = kernels[0]
    ask(arbiter, processes[0], 1)
    ask(arbiter, processes[0], 2, "grow", 40 * GiB)
    assert grower.granted == BUDGET  # capped at its budget
    ask(arbiter, processes[0], 3, "grow", MiB)
    assert grower.granted == BUDGET  # a small ask later takes nothing back


def test_a_kernel_that_runs_no_cell_is_denied_room_to_grow_at_once(processes):
    arbiter, _, kernels = node(processes)
    [answer] = ask(arbiter, processes[0], 5, "grow", 4 * GiB)
    assert answer["type"] == "deny", answer
    assert "runs no cell" in answer["message"], answer
    assert kernels[0].granted == 0
    assert kernels[0].state == books.IDLE
    assert decided(arbiter, "pause") == decided(arbiter, "grown") == []


def test_a_cell_waits_while_the_running_cells_budgets_and_its_own_pass_the_card(processes):
    arbiter, _, kernels = node(processes, free=40 * GiB)
    arbiter.config.queue_timeout = 0.5
    for k in kernels[2:]:  # two cells of 35 GiB budgets run, granted little: room is free now
        k.server.slice = dataclasses.replace(k.slice, memory_limit=35 * GiB)
        k.state, k.granted = books.ACTIVE, 3 * GiB
    [*waits, answer] = ask(arbiter, processes[0], 1)
    # 8 + 35 + 35 GiB of budgets against the 51 GiB the kernels could hold at most: the
    # 40 GiB free and the 11 GiB they hold; and no word of GPU memory "needed"
    assert answer["type"] == "deny", answer
    said = (
        "the budgets of the 2 running cell(s) and this one's pass what the GPU could give them "
        "at once by 27.00 GiB"
    )
    assert said in answer["message"], answer
    assert waits, "the cell is told why it waits"
    assert all(said in w["message"] for w in waits), waits
    assert "needed" not in answer["message"], answer
    assert decided(arbiter, "pause") == [], "nobody leaves for a cell that could not be admitted"
    kernels[2].state, kernels[2].granted = books.IDLE, 0  # one of them ends
    assert ask(arbiter, processes[0], 2)[-1] == {"type": "grant", "id": 2}


def test_a_prefetch_makes_room_ahead_for_what_its_cell_starts_with_alone(processes):
    arbiter, card, kernels = node(processes)
    grower = kernels[0]
    grower.state, grower.paused_bytes = books.PAUSED, 2 * GiB  # back: its context, 2 GiB of data
    card.held[processes[0]] = CONTEXT
    card.reserve += GiB - CONTEXT  # the same free memory

    async def prefetched():
        conn = arbiter.conns[processes[0]]
        await arbiter.rooms.prefetch(conn, 1)
        if conn.ahead_task is not None:
            await conn.ahead_task

    asyncio.run(prefetched())
    assert arbiter.conns[processes[0]].told[0] == {"type": "grant", "id": 1}
    # its 2 GiB back and the 1 GiB margin fit the 3 GiB free: nobody was taken off ahead
    assert decided(arbiter, "pause") == decided(arbiter, "suspend") == []


def test_the_books_start_grow_and_admit_as_said():
    slice_ = Slice(CARD, 0, "H100", 80 * GiB, 16 * GiB, 50)
    server = books.Server(1, "ada", "", slice_)
    k = books.Kernel(1, server, resident=GiB, paused_bytes=3 * GiB, checkpoint_bytes=CONTEXT)
    assert books.start_asks(k, GiB) == GiB + 3 * GiB + CONTEXT + GiB
    assert books.start_asks(k, 100 * GiB) == 16 * GiB  # never past the budget
    k.granted = 10 * GiB
    assert books.grow_asks(k, MiB, 0) == 10 * GiB + MiB  # on top of what it was granted
    assert books.grow_asks(k, 2 * GiB, GiB) == 13 * GiB
    k.resident = 12 * GiB  # holds more than it was granted (NVML saw it grow)
    assert books.grow_asks(k, 2 * GiB, GiB) == 15 * GiB
    k.resident = GiB
    k.server.slice = dataclasses.replace(slice_, memory_limit=4 * GiB, memory_request=4 * GiB)  # lowered
    assert books.grow_asks(k, 2 * GiB, GiB) == 10 * GiB  # what a running cell was granted stays
    k.server.slice = slice_
    k.asks = 5 * GiB
    assert books.growth(k, 70 * GiB, []) == 5 * GiB
    k.asks = 0
    assert books.growth(k, 70 * GiB, []) == 16 * GiB  # 0: the whole budget, as without
    others = [books.Kernel(p, books.Server(p, f"u{p}", "", slice_), resident=GiB) for p in (2, 3, 4, 5)]
    for o in others[:3]:
        o.state = books.ACTIVE
    # ceiling: 40 GiB free + 5 GiB held = 45; 4 budgets of 16 = 64 (the idle one counts not)
    assert books.admission_short(k, 40 * GiB, others) == 64 * GiB - 45 * GiB
    others[0].state = books.IDLE
    assert books.admission_short(k, 40 * GiB, others) == 3 * GiB
    others[1].state = books.IDLE
    assert books.admission_short(k, 40 * GiB, others) == 0


class Writer:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


class Channel:
    """A second connection of a process, as :class:`.sessions.Connection` stands for it to
    :meth:`.sessions.Sessions.channel`: its peer's pid and identity, what it is told."""

    def __init__(self, pid: int):
        self.pid, self.identity, self.writer, self.told = pid, procs.Identity.of(pid), Writer(), []
        self.kernel = self.hello = self.channel_of = None

    async def send(self, msg: dict) -> None:
        self.told.append(msg)


def said(arbiter: Arbiter, channel: Channel, *messages: dict) -> list[dict]:
    """``messages`` dispatched on ``channel`` in turn, each request decided; what it was told."""

    async def go():
        for msg in messages:
            await arbiter.sessions.dispatch(channel, msg)
            kernel_conn = channel.channel_of
            if kernel_conn is not None and kernel_conn.room_task is not None:
                await kernel_conn.room_task

    asyncio.run(go())
    return channel.told


OPEN = {"type": "channel", "version": 4, "for": "grow"}


def test_a_kernels_grow_channel_carries_its_requests_and_their_answers(processes):
    arbiter, card, kernels = node(processes)
    ask(arbiter, processes[0], 1)
    card.held[processes[0]] = 2 * GiB
    channel = Channel(processes[0])
    told = said(arbiter, channel, OPEN, {"type": "room", "id": 7, "for": "grow", "bytes": 4 * GiB})
    assert told[0] == {"type": "ok"}
    assert told[-1] == {"type": "grant", "id": 7}  # on the channel, not the kernel's connection
    assert not [m for m in arbiter.conns[processes[0]].told if m.get("id") == 7]
    assert kernels[0].granted == 2 * GiB + 4 * GiB + arbiter.config.grant_margin
    assert [d["server"] for d in decided(arbiter, "pause")] == ["user1/"]


@pytest.mark.parametrize(
    ("whose", "on_demand", "says"),
    [
        ("another process", True, "no kernel of this process is connected"),
        ("the kernel", False, "this node grants cells their whole budget"),
    ],
)
def test_a_grow_channel_is_refused_to_all_but_a_kernel_granted_growth_on_demand(
    processes, whose, on_demand, says
):
    arbiter, _, _ = node(processes[:3], on_demand=on_demand)
    pid = processes[3] if whose == "another process" else processes[0]
    channel = Channel(pid)
    [refusal] = said(arbiter, channel, OPEN)
    assert refusal["type"] == "error", refusal
    assert says in refusal["message"], refusal
    assert channel.writer.closed
    assert channel.channel_of is None


def test_a_kernel_of_version_3_gets_no_channel_and_a_channel_carries_grow_alone(processes):
    arbiter, _, _ = node(processes, version=3)
    [refusal] = said(arbiter, Channel(processes[0]), OPEN)
    assert "whole budget" in refusal["message"], refusal
    arbiter, _, _ = node(processes)
    channel = Channel(processes[0])
    told = said(arbiter, channel, OPEN, {"type": "room", "id": 2, "for": "run"})
    assert told[-1] == {"type": "error", "message": "a grow channel carries room for: grow alone"}
