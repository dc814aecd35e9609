"""Cells take turns on a card (``ArbiterApp.turn_wait``, :mod:`jupyter_vgpu.node.turns`):
a cell waits for the cells running on its card, and for those in line before it, up to
the setting, then starts beside them. Through the arbiter's own path (its books and
rooms, the kernels' connections answering as kernels do), with NVML's reading stood in
by the card model of ``tests/unit/test_room_ahead.py``, where every cell here has room:
``pids[5]`` runs a cell (its room granted), ``pids[0]`` and ``pids[6]`` send theirs."""

import asyncio
import dataclasses
import time

import pytest

from jupyter_vgpu.node import books
from jupyter_vgpu.testing.waiting import wait_for_async

from .sleepers import sleeping
from .test_room_ahead import decided, node


@pytest.fixture
def processes():
    with sleeping(7) as pids:
        yield pids


def card(pids: list[int], turn_wait: float):
    """:func:`test_room_ahead.node` with room for every cell, ``turn_wait`` set, and
    ``pids[5]`` running a cell."""
    arbiter, _, kernels = node(pids, short_contexts=-4)
    arbiter.config.turn_wait = turn_wait
    arbiter.config.queue_timeout = 60.0
    kernels[5].state, kernels[5].granted = books.ACTIVE, 3 * 2**30
    kernels[5].since = time.monotonic()  # its cell began now
    return arbiter, kernels


def told(arbiter, pid: int, rid: int) -> list[dict]:
    return [m for m in arbiter.conns[pid].told if m.get("id") == rid]


def granted(arbiter, pid: int, rid: int) -> bool:
    return any(m["type"] == "grant" for m in told(arbiter, pid, rid))


def waiting(arbiter, pid: int, rid: int) -> bool:
    return any(m["type"] == "wait" for m in told(arbiter, pid, rid))


async def ask(arbiter, pid: int, rid: int, cell: bool = True) -> None:
    """Kernel ``pid``'s request ``rid`` for room to run, as its connection sends it."""
    await arbiter.rooms.request(arbiter.conns[pid], rid, "run", cell=cell)


async def until(condition, what: str) -> None:
    await wait_for_async(condition, 10, what)


def end_cell(kernel: books.Kernel) -> None:
    """The kernel's cell ends, as its report says (:meth:`Sessions.state`)."""
    kernel.state, kernel.granted = books.IDLE, 0


def test_a_cell_waits_for_the_running_cell_then_runs_as_it_ends(processes):
    arbiter, kernels = card(processes, turn_wait=30.0)
    ada = processes[0]

    async def go():
        await ask(arbiter, ada, 1)
        await until(lambda: waiting(arbiter, ada, 1), "ada's cell told it waits its turn")
        assert not granted(arbiter, ada, 1)
        end_cell(kernels[5])
        await arbiter.notify()
        await until(lambda: granted(arbiter, ada, 1), "ada's cell granted once the other ended")

    asyncio.run(go())
    [wait, *_] = told(arbiter, ada, 1)
    assert wait["message"].startswith("waiting for its turn on GPU 0: 1 cell(s) running, 0 ahead in line"), (
        wait
    )
    [turn] = decided(arbiter, "turn")
    assert turn["server"] == "user0/"
    assert turn["message"] == "behind 1 running cell(s) and 0 in line: its turn came", turn
    assert kernels[0].state == books.ACTIVE
    assert arbiter.turns.lines["GPU-78b63d1a-c3a4-1316-c904-a077699c919c"] == []


def test_a_cell_waits_for_a_running_cell_only_until_that_cell_has_run_turn_wait(processes):
    arbiter, kernels = card(processes, turn_wait=0.5)
    kernels[5].since -= 0.2  # its cell began 0.2 s ago: long in 0.3 s
    long_at = kernels[5].since + 0.5

    async def go():
        await ask(arbiter, processes[0], 1)
        await until(lambda: granted(arbiter, processes[0], 1), "ada's cell granted beside the long one")

    asyncio.run(go())
    assert time.monotonic() >= long_at
    assert kernels[5].state == books.ACTIVE, "the long cell runs on"
    [turn] = decided(arbiter, "turn")
    assert turn["message"].endswith("the 1 cell(s) running had run 0.5 s: it runs beside them"), turn


def test_a_cell_sent_once_the_running_cell_has_run_turn_wait_waits_for_nothing(processes):
    arbiter, kernels = card(processes, turn_wait=2.0)
    kernels[5].since -= 5.0  # a training loop, 5 s in

    async def go():
        await ask(arbiter, processes[0], 1)
        await until(lambda: granted(arbiter, processes[0], 1), "ada's cell granted at once")

    asyncio.run(go())
    assert not waiting(arbiter, processes[0], 1)
    assert decided(arbiter, "turn") == []


def test_a_cell_behind_a_young_cell_starts_beside_it_once_its_own_wait_is_over(processes):
    arbiter, kernels = card(processes, turn_wait=0.6)
    kernels[5].since -= 0.3  # long in 0.3 s: bob's cell then runs beside it, young
    ada, bob = processes[0], processes[6]
    t0 = time.monotonic()

    async def go():
        await ask(arbiter, bob, 1)
        await until(lambda: waiting(arbiter, bob, 1), "bob in line")
        await ask(arbiter, ada, 1)
        await until(lambda: granted(arbiter, bob, 1), "bob's cell granted beside the long one")
        assert not granted(arbiter, ada, 1), "ada waits for bob's young cell"
        await until(lambda: granted(arbiter, ada, 1), "ada's cell granted once her wait was over")

    asyncio.run(go())
    assert time.monotonic() - t0 >= 0.6
    assert kernels[6].state == books.ACTIVE, "bob's cell runs on"
    turns = {d["server"]: d["message"] for d in decided(arbiter, "turn")}
    assert turns["user6/"].endswith("had run 0.6 s: it runs beside them"), turns
    assert turns["user0/"] == "behind 1 running cell(s) and 1 in line: its 0.6 s wait ran out", turns


@pytest.mark.parametrize(("turn_wait", "cell"), [(30.0, False), (0.0, True)], ids=["not a cell", "turns off"])
def test_requests_that_are_not_cells_and_cells_with_turns_off_never_wait_in_line(processes, turn_wait, cell):
    arbiter, _ = card(processes, turn_wait=turn_wait)
    t0 = time.monotonic()

    async def go():
        await ask(arbiter, processes[0], 1, cell=cell)
        await until(lambda: granted(arbiter, processes[0], 1), "ada's request granted at once")

    asyncio.run(go())
    assert time.monotonic() - t0 < 5
    assert not waiting(arbiter, processes[0], 1)
    assert decided(arbiter, "turn") == []


def test_cells_take_their_turns_in_the_order_they_were_sent(processes):
    arbiter, kernels = card(processes, turn_wait=30.0)
    ada, bob = processes[0], processes[6]

    async def go():
        await ask(arbiter, ada, 1)
        await until(lambda: waiting(arbiter, ada, 1), "ada in line")
        await ask(arbiter, bob, 1)
        await until(lambda: waiting(arbiter, bob, 1), "bob in line behind her")
        assert "1 cell(s) running, 1 ahead in line" in told(arbiter, bob, 1)[0]["message"]
        end_cell(kernels[5])
        await arbiter.notify()
        await until(lambda: granted(arbiter, ada, 1), "ada's turn")
        assert not granted(arbiter, bob, 1), "bob waits for ada's cell now"
        end_cell(kernels[0])
        await arbiter.notify()
        await until(lambda: granted(arbiter, bob, 1), "bob's turn")

    asyncio.run(go())
    assert [d["server"] for d in decided(arbiter, "turn")] == ["user0/", "user6/"]


def test_a_cell_of_higher_priority_waits_for_no_cell_below_it(processes):
    arbiter, kernels = card(processes, turn_wait=30.0)
    bob = processes[6]

    async def go():  # the new slice is sent to bob's kernel: from within the loop
        arbiter.register(bob, "user6", "", dataclasses.replace(kernels[6].slice, priority=90))
        await ask(arbiter, bob, 1)
        await until(lambda: granted(arbiter, bob, 1), "bob's cell granted beside the lower one")

    asyncio.run(go())
    assert not waiting(arbiter, bob, 1)
    assert decided(arbiter, "turn") == []


def test_a_kernel_that_leaves_while_in_line_gives_up_its_place(processes):
    arbiter, kernels = card(processes, turn_wait=30.0)
    ada, bob = processes[0], processes[6]
    gone_told: list[dict] = []

    async def go():
        await ask(arbiter, ada, 1)
        await until(lambda: waiting(arbiter, ada, 1), "ada in line")
        await ask(arbiter, bob, 1)
        await until(lambda: waiting(arbiter, bob, 1), "bob in line behind her")
        gone = arbiter.conns.pop(ada)  # ada's kernel hangs up
        gone_told.extend(gone.told)
        end_cell(kernels[5])
        await arbiter.notify()
        await until(lambda: granted(arbiter, bob, 1), "bob's turn, ada gone")

    asyncio.run(go())
    assert not any(m["type"] == "grant" for m in gone_told)


def test_a_cell_given_up_while_in_line_holds_nobody_up(processes):
    arbiter, kernels = card(processes, turn_wait=30.0)
    ada, bob = processes[0], processes[6]

    async def go():
        await ask(arbiter, ada, 1)
        kernels[0].state = books.ACTIVE  # her cell's report, after its request
        await until(lambda: waiting(arbiter, ada, 1), "ada in line")
        await ask(arbiter, bob, 1)
        await until(lambda: waiting(arbiter, bob, 1), "bob in line behind her")
        kernels[0].state = books.IDLE  # she interrupts her cell: the kernel reports itself idle
        end_cell(kernels[5])
        await arbiter.notify()
        await until(lambda: granted(arbiter, bob, 1), "bob's turn, ada's cell given up")

    asyncio.run(go())
    assert told(arbiter, ada, 1)[-1]["type"] == "deny", "no room made for a cell given up"
    assert not granted(arbiter, ada, 1)
    ada_turn = [d for d in decided(arbiter, "turn") if d["server"] == "user0/"]
    assert ada_turn[0]["message"].endswith("the cell was given up"), ada_turn


def back_idle(arbiter, kernel: books.Kernel) -> None:
    """``kernel``'s report that its code ended (:meth:`Sessions.state`, the arbiter's own path)."""
    figures = {"resident": kernel.resident, "paused_bytes": 0, "host_bytes": 0, "resume_seconds": None}
    arbiter.sessions.state(kernel, {"state": "idle", **figures})


def test_a_kernel_that_ran_code_past_turn_wait_on_a_request_it_did_not_call_a_cell_takes_turns_since(
    processes,
):
    arbiter, kernels = card(processes, turn_wait=0.5)
    ada = processes[0]

    async def go():
        # not called a cell: granted at once beside the young running cell
        await ask(arbiter, ada, 1, cell=False)
        await until(lambda: granted(arbiter, ada, 1), "ada's request granted at once")
        assert not waiting(arbiter, ada, 1)
        kernels[0].unsaid_since -= 0.8  # its code ran 0.8 s from the grant
        back_idle(arbiter, kernels[0])
        assert kernels[0].turns_kept
        kernels[5].since = time.monotonic()  # a young cell runs again
        await ask(arbiter, ada, 2, cell=False)
        await until(lambda: waiting(arbiter, ada, 2), "ada's next request waits its turn, cell or not")
        await until(lambda: granted(arbiter, ada, 2), "ada's request granted once the other turned long")

    asyncio.run(go())
    [kept] = decided(arbiter, "turns kept")
    assert kept["server"] == "user0/"
    assert "did not say it was a cell: its requests take turns from now on" in kept["message"], kept
    assert kept["seconds"] >= 0.8
    assert [d["server"] for d in decided(arbiter, "turn")] == ["user0/"]


@pytest.mark.parametrize("cell", [False, True], ids=["short, not a cell", "a long cell"])
def test_a_short_request_or_a_cell_leaves_the_kernels_word_as_it_was(processes, cell):
    arbiter, kernels = card(processes, turn_wait=0.5)
    kernels[5].since -= 5.0  # long: nobody waits for it
    ada = processes[0]

    async def go():
        await ask(arbiter, ada, 1, cell=cell)
        await until(lambda: granted(arbiter, ada, 1), "ada's request granted at once")
        if cell:  # her cell ran 0.8 s: it said what it was
            kernels[0].since -= 0.8
        back_idle(arbiter, kernels[0])

    asyncio.run(go())
    assert not kernels[0].turns_kept
    assert decided(arbiter, "turns kept") == []
