"""A prefetch makes the room its cell will need (:meth:`.room.Rooms.prefetch`), through the
arbiter's own path: its books, its rooms and its moves, the kernels' connections
answering as kernels that paused, with NVML's reading and the driver's checkpoint stood
in by a model of one card (what each process holds on it; a suspend takes a process's
bytes off it). The same on the real card and driver: ``tests/gpu/test_room_ahead_gpu.py``."""

import asyncio
import os
import threading
import time

import pytest

from jupyter_vgpu.host import procs
from jupyter_vgpu.node import books, disk
from jupyter_vgpu.node.app import ArbiterApp
from jupyter_vgpu.node.arbiter import Arbiter
from jupyter_vgpu.node.cards import Reading
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.waiting import wait_for, wait_for_async

from .answering import Answering
from .sleepers import sleeping

GiB, MiB = 2**30, 2**20
CONTEXT = 700 * MiB
CARD = "GPU-0"


class Card:
    """What each process holds on the card, and the bytes out of every kernel's reach."""

    def __init__(self, total: int, reserve: int):
        self.total, self.reserve, self.held = total, reserve, {}

    async def read(self, uuid: str) -> Reading:
        return Reading(self.total, self.reserve + sum(self.held.values()), dict(self.held))


class Checkpoint:
    """The driver's checkpoint of the card model: a suspend takes its processes off it."""

    Timeout = TimeoutError

    def __init__(self, card: Card):
        self.card, self.calls = card, []
        self.entered = threading.Event()  # a suspend is in the driver
        self.held: threading.Event | None = None  # set: suspends wait for it
        #: set: each suspend waits (up to 5 s) until this many were in the driver at once,
        #: so that suspends made together are seen together however loaded the machine
        self.together: int | None = None
        self.in_driver = self.most_at_once = 0
        self._changed = threading.Condition()

    def suspend(self, pids: list[int], nbytes: int) -> None:
        start = time.monotonic()
        with self._changed:
            self.in_driver += 1
            self.most_at_once = max(self.most_at_once, self.in_driver)
            self._changed.notify_all()
            if self.together is not None:
                self._changed.wait_for(lambda: self.most_at_once >= self.together, timeout=5)
        self.entered.set()
        if self.held is not None:
            assert self.held.wait(10), "the test never let the suspend go on"
        time.sleep(0.05)  # the driver's time
        with self._changed:
            self.in_driver -= 1
        for pid in pids:
            self.card.held.pop(pid, None)
        self.calls.append((pids, start, time.monotonic()))

    def restore(self, pids: list[int], need: dict[str, int] | None = None) -> float:
        """Brings ``pids`` back (``need``: bytes per card, the last pid's); it lasts until a
        suspend has been in the driver beside it (5 s at most), and says in ``beside``
        whether one was."""
        with self._changed:
            self.beside = self._changed.wait_for(lambda: self.most_at_once > 0, timeout=5)
        self.card.held[pids[-1]] = sum((need or {}).values())
        return 0.05


@pytest.fixture
def processes():
    with sleeping(7) as pids:
        yield pids


def card_arbiter(card: Card, **settings) -> Arbiter:
    """An arbiter of the card model ``card`` (its reading stands in for NVML's, its
    checkpoint for the driver's), with these tests' settings (no suspend within the hour
    in the background, the watermark out of the way) and ``settings``."""
    config = ArbiterApp(registrars="none", host_reserve=1, suspend_after=3600.0, watermark=0.99, **settings)
    arbiter = Arbiter(config, checkpoint=Checkpoint(card))
    arbiter.read = card.read
    return arbiter


def joined(arbiter: Arbiter, pid: int, i: int, budget: int, resident: int) -> books.Kernel:
    """The kernel of process ``pid``, ``user{i}``'s, on the card model's card (80 GiB, a
    slice of ``budget`` bytes), in ``arbiter``'s books holding ``resident`` bytes; its
    state and connection are the caller's to set."""
    server = arbiter.register(pid, f"user{i}", "", Slice(CARD, 0, "H100", 80 * GiB, budget, 50))
    kernel = books.Kernel(pid, server, f"k{i}", uid=os.getuid(), identity=procs.Identity.of(pid))
    kernel.resident = resident
    return kernel


def node(
    pids: list[int], short_contexts: float, idle_pid_seconds: float = 0.0, host_limit: int | None = None
):
    """An arbiter and its kernels: ``pids[0]`` the grower (8 GiB budget, paused, 100 MiB to
    bring back, its context on the card), ``pids[1:5]`` paused kernels keeping a context
    each, ``pids[5]`` an idle kernel holding 3 GiB, idle for ``idle_pid_seconds`` (its
    slice's idle_seconds: 300). The card's reserve leaves the grower's cell
    ``short_contexts`` contexts short of its room; ``host_limit``: the node's
    ``host_memory_limit``, bytes (default: the arbiter's)."""
    budget = 8 * GiB
    free = budget - CONTEXT - int(short_contexts * CONTEXT)
    held = {pid: CONTEXT for pid in pids[:5]} | {pids[5]: 3 * GiB} | {pid: GiB for pid in pids[6:7]}
    card = Card(80 * GiB, 0)
    card.reserve = card.total - free - sum(held.values())
    card.held = held
    arbiter = card_arbiter(card, **({} if host_limit is None else {"host_memory_limit": host_limit}))
    now = time.monotonic()
    kernels = []
    for i, pid in enumerate(pids[:7]):
        kernel = joined(arbiter, pid, i, {0: budget, 6: 2 * GiB}.get(i, 4 * GiB), held[pid])
        if i < 5:
            kernel.state, kernel.since = books.PAUSED, now - 60
            kernel.paused_bytes = 100 * MiB if i == 0 else GiB
        else:
            kernel.state, kernel.since = books.IDLE, now - (idle_pid_seconds if i == 5 else 0)
        arbiter.conns[pid] = Answering(kernel)
        kernels.append(kernel)
    return arbiter, card, kernels


def prefetch(arbiter: Arbiter, conn: Answering, rid: int) -> None:
    """The prefetch ``rid`` of the kernel on ``conn``, and the room made ahead of its cell."""

    async def prefetched():
        await arbiter.rooms.prefetch(conn, rid)
        if conn.ahead_task is not None:
            await conn.ahead_task

    asyncio.run(prefetched())


def decided(arbiter: Arbiter, what: str) -> list[dict]:
    return [d for d in arbiter.decisions if d["what"] == what]


def test_a_prefetch_suspends_what_its_cell_will_need_together_and_grants_first(processes):
    arbiter, card, kernels = node(processes[:6], short_contexts=3.5)
    grower = arbiter.conns[processes[0]]
    arbiter.checkpoint.together = 4
    prefetch(arbiter, grower, 7)
    assert grower.told[0] == {"type": "grant", "id": 7}  # before the room is made: it comes back meanwhile
    suspends = decided(arbiter, "suspend")
    assert sorted(d["server"] for d in suspends) == ["user1/", "user2/", "user3/", "user4/"]
    assert {d["reason"] for d in suspends} == {"room ahead for user0/"}
    assert arbiter.checkpoint.most_at_once == 4, "one after another"
    assert kernels[5].state == books.IDLE  # within its idle_seconds: it stays
    # back on the card, its cell finds its room made: nothing left to free for it
    kernels[0].state, kernels[0].resident = books.IDLE, CONTEXT + 100 * MiB
    card.held[processes[0]] = CONTEXT + 100 * MiB
    reading = asyncio.run(card.read(CARD))
    assert books.shortfall(kernels[0], reading.free, kernels[1:], CARD) == 0


def test_a_prefetch_pauses_kernels_idle_past_their_idle_seconds_before_suspending(processes):
    arbiter, _, _ = node(processes[:6], short_contexts=3.5, idle_pid_seconds=400)
    prefetch(arbiter, arbiter.conns[processes[0]], 1)
    assert [d["server"] for d in decided(arbiter, "pause")] == ["user5/"]
    assert decided(arbiter, "suspend") == []  # its 3 GiB covered the room
    assert decided(arbiter, "pause")[0]["reason"] == "room ahead for user0/"


def test_a_prefetch_with_room_enough_takes_nobody_off(processes):
    arbiter, _, kernels = node(processes[:6], short_contexts=0)
    grower = arbiter.conns[processes[0]]
    prefetch(arbiter, grower, 1)
    assert grower.told == [{"type": "grant", "id": 1}]
    assert decided(arbiter, "suspend") == decided(arbiter, "pause") == []
    assert [k.state for k in kernels[1:]] == [books.PAUSED] * 4 + [books.IDLE]


class SlowToPause(Answering):
    """A kernel whose pause lasts until the test lets it end (its pinned memory made anew:
    2.5 s on the H200, seed 11 at f922f59)."""

    def __init__(self, kernel: books.Kernel):
        super().__init__(kernel)
        self.pausing, self.go_on = asyncio.Event(), asyncio.Event()

    async def ask(self, msg: dict, timeout: float, sent=None) -> dict:
        if msg["type"] == "pause":
            self.pausing.set()
            await self.go_on.wait()
        return await super().ask(msg, timeout, sent)


def test_pauses_owed_to_the_watermark_are_made_after_the_grant_of_a_prefetch_that_fits(processes):
    # the card above its watermark with a kernel idle past its idle_seconds: the prefetch
    # fits beside it, so its pause, slow, is made after the grant and outside the card's lock
    arbiter, _, kernels = node(processes[:6], short_contexts=0, idle_pid_seconds=400)
    arbiter.config.watermark = 0.5
    idle = arbiter.conns[processes[5]] = SlowToPause(kernels[5])
    grower = arbiter.conns[processes[0]]

    async def run():
        await asyncio.wait_for(arbiter.rooms.prefetch(grower, 1), 5)  # not waiting for the pause
        assert grower.told == [{"type": "grant", "id": 1}]
        await asyncio.wait_for(idle.pausing.wait(), 5)
        assert kernels[5].moving == "pause"  # marked: no room or other move takes it meanwhile
        assert arbiter.locks[CARD].locked() is False  # made outside the card's lock
        idle.go_on.set()
        await wait_for_async(lambda: kernels[5].moving is None, 5, "the owed pause to end")

    asyncio.run(run())
    pauses = decided(arbiter, "pause")
    assert [(d["server"], d["reason"]) for d in pauses] == [("user5/", "idle")]
    assert decided(arbiter, "suspend") == []


class BreaksOnPause(Answering):
    """A kernel whose connection fails as it is asked to pause (a fault of the arbiter's
    own path, not a refusal)."""

    async def ask(self, msg: dict, timeout: float, sent=None) -> dict:
        if msg["type"] == "pause":
            raise RuntimeError("the connection broke, for the test")
        return await super().ask(msg, timeout, sent)


def test_a_fault_of_an_owed_pause_after_the_grant_is_a_decision_and_leaves_no_mark(processes):
    arbiter, _, kernels = node(processes[:6], short_contexts=0, idle_pid_seconds=400)
    arbiter.config.watermark = 0.5
    arbiter.conns[processes[5]] = BreaksOnPause(kernels[5])
    grower = arbiter.conns[processes[0]]

    async def run():
        await asyncio.wait_for(arbiter.rooms.prefetch(grower, 1), 5)
        await wait_for_async(lambda: decided(arbiter, "pause failed"), 5, "the owed pause's fault decided")

    asyncio.run(run())
    assert grower.told == [{"type": "grant", "id": 1}], "the prefetch stands"
    assert "RuntimeError: the connection broke" in decided(arbiter, "pause failed")[0]["message"]
    assert kernels[5].moving is None, "left for the next look"


def test_pauses_owed_to_the_watermark_are_made_before_a_prefetch_whose_return_needs_them(processes):
    # 3 GiB short of the kernel's own return: the idle kernel's pause is what makes it fit
    arbiter, card, kernels = node(processes[:6], short_contexts=0, idle_pid_seconds=400)
    arbiter.config.watermark = 0.5
    kernels[0].paused_bytes = 9 * GiB
    reading = asyncio.run(card.read(CARD))
    assert books.prefetch_short(kernels[0], reading.free, kernels[1:], CARD) > 0
    grower = arbiter.conns[processes[0]]
    prefetch(arbiter, grower, 1)
    pauses = decided(arbiter, "pause")
    assert [(d["server"], d["reason"]) for d in pauses][:1] == [("user5/", "idle")]
    order = [d["what"] for d in arbiter.decisions]
    assert order.index("pause") < order.index("prefetch")  # made before it was granted


def test_a_fault_making_room_ahead_is_a_decision_and_the_prefetch_stands(processes):
    arbiter, _, _ = node(processes[:6], short_contexts=3.5)
    grower = arbiter.conns[processes[0]]

    async def broken(*args, **kwargs):
        raise RuntimeError("the card went away")

    arbiter.moves.take_off = broken
    prefetch(arbiter, grower, 3)
    assert grower.told == [{"type": "grant", "id": 3}]  # granted, and nothing said after it
    [failed] = decided(arbiter, "room ahead failed")
    assert failed["message"] == "RuntimeError: the card went away"
    assert decided(arbiter, "prefetch")


def test_suspends_go_together_as_far_as_the_host_holds_their_checkpoints(processes):
    # room in the node's host budget for two checkpoints of a context, not three: two go
    # at once, where all or none sent all four one at a time; the others stay, said why
    arbiter, _, _ = node(processes[:6], short_contexts=3.5, host_limit=int(2.5 * CONTEXT))
    arbiter.checkpoint.together = 2
    prefetch(arbiter, arbiter.conns[processes[0]], 1)
    assert sorted(d["server"] for d in decided(arbiter, "suspend")) == ["user1/", "user2/"]
    assert len(arbiter.checkpoint.calls) == 2
    assert arbiter.checkpoint.most_at_once == 2, "one after another"
    skipped = decided(arbiter, "suspend skipped")
    assert [d["server"] for d in skipped] == ["user3/", "user4/"]
    assert all("host memory for paused kernels is full" in d["message"] for d in skipped), skipped


def test_room_ahead_off_brings_back_the_kernels_own_bytes_alone(processes):
    arbiter, _, kernels = node(processes[:6], short_contexts=3.5)
    arbiter.config.room_ahead = False  # ArbiterApp.room_ahead, the admin's setting
    grower = arbiter.conns[processes[0]]
    prefetch(arbiter, grower, 1)
    assert grower.told == [{"type": "grant", "id": 1}]
    assert decided(arbiter, "suspend") == decided(arbiter, "pause") == []
    assert [k.state for k in kernels[1:5]] == [books.PAUSED] * 4


def steps_held(arbiter: Arbiter, conn: Answering, during) -> None:
    """Prefetch the kernel on ``conn`` with the driver's first suspend held; once it is in
    the driver, ``during()`` (a coroutine function: another request) runs and gets as far
    as it can, then the suspend goes on; returns once the room ahead and every request
    for room have ended."""
    checkpoint = arbiter.checkpoint
    checkpoint.held = threading.Event()

    async def scenario():
        await arbiter.rooms.prefetch(conn, 1)
        assert await asyncio.to_thread(checkpoint.entered.wait, 10), "no suspend made ahead"
        await during()
        await asyncio.sleep(0)  # its request gets as far as the card's lock
        checkpoint.held.set()
        tasks = [c.room_task for c in arbiter.conns.values()] + [conn.ahead_task]
        await asyncio.gather(*[t for t in tasks if t is not None])

    asyncio.run(scenario())


def test_another_users_cell_gets_the_card_between_two_steps_of_a_room_ahead(processes):
    # the grower's cell is six contexts short: the four paused kernels' suspends (together),
    # then the pause of the kernel idle past its idle_seconds; meanwhile user6's cell asks
    # for room, and gets it after the suspends, not after the room ahead of a cell that
    # has not started
    arbiter, _, kernels = node(processes, short_contexts=6, idle_pid_seconds=400)
    arbiter.config.suspend_after = 30  # the paused kernels are due a suspend: they go first
    order = []
    for c in arbiter.conns.values():
        c.send = lambda msg, c=c: order.append((c.kernel.server.key, msg["type"])) or asyncio.sleep(0)
        c.ask = lambda msg, timeout, sent=None, c=c: (
            order.append((c.kernel.server.key, msg["type"]))
            or asyncio.sleep(0, {"ok": True, "message": "done", "released": 0})
        )
    other = arbiter.conns[processes[6]]
    steps_held(arbiter, arbiter.conns[processes[0]], lambda: arbiter.rooms.request(other, 5, "run"))
    ahead = [d for d in arbiter.decisions if d.get("reason") == "room ahead for user0/"]
    assert sorted((d["what"], d["server"]) for d in ahead[:4]) == [
        ("suspend", "user1/"), ("suspend", "user2/"), ("suspend", "user3/"), ("suspend", "user4/"),
    ]  # fmt: skip
    assert [(d["what"], d["server"]) for d in ahead[4:]] == [("pause", "user5/")]
    assert ("user6/", "grant") in order, order
    assert order.index(("user6/", "grant")) < order.index(("user5/", "pause")), order
    assert kernels[6].state == books.ACTIVE


def test_the_kernels_own_cell_stops_its_room_ahead_and_makes_the_rest(processes):
    arbiter, card, _ = node(processes[:6], short_contexts=6, idle_pid_seconds=400)
    arbiter.config.suspend_after = 30
    grower = arbiter.conns[processes[0]]

    async def pause(msg, timeout, sent=None):  # user5's pause gives its 3 GiB back to the card
        return {"ok": True, "message": "done", "released": card.held.pop(processes[5])}

    arbiter.conns[processes[5]].ask = pause
    steps_held(arbiter, grower, lambda: arbiter.rooms.request(grower, 2, "run"))
    suspends = decided(arbiter, "suspend")
    assert sorted(d["server"] for d in suspends) == ["user1/", "user2/", "user3/", "user4/"]
    assert {d["reason"] for d in suspends} == {"room ahead for user0/"}
    # the rest of its room: made by its cell's own request, not by the room ahead
    [pause] = decided(arbiter, "pause")
    assert (pause["server"], pause["reason"]) == ("user5/", "room for user0/")
    assert grower.told[-1] == {"type": "grant", "id": 2}


def short_of_return(processes: list[int], contexts: float):
    """:func:`node` with the grower's paused bytes ``contexts`` contexts more than the card
    has free: its return itself is short."""
    arbiter, card, kernels = node(processes[:6], short_contexts=3.5)
    free = asyncio.run(card.read(CARD)).free
    kernels[0].paused_bytes = free + int(contexts * CONTEXT)
    return arbiter, kernels


def test_a_prefetch_short_of_its_return_suspends_paused_kernels_then_grants(processes):
    # 1.5 contexts short of coming back: two paused kernels' suspends, together, before the
    # grant; then the room ahead of its cell, the other two
    arbiter, _ = short_of_return(processes, 1.5)
    grower = arbiter.conns[processes[0]]
    prefetch(arbiter, grower, 4)
    assert grower.told == [{"type": "grant", "id": 4}]
    whats = [(d["what"], d.get("server")) for d in arbiter.decisions if d["what"] in ("suspend", "prefetch")]
    assert sorted(whats[:2]) == [("suspend", "user1/"), ("suspend", "user2/")], whats
    assert whats[2] == ("prefetch", "user0/"), whats
    assert sorted(whats[3:]) == [("suspend", "user3/"), ("suspend", "user4/")], whats
    assert {d["reason"] for d in decided(arbiter, "suspend")} == {"room ahead for user0/"}


def test_a_prefetch_short_of_its_return_is_refused_where_one_step_does_not_cover_it(processes):
    # five contexts short, four paused kernels: what one step could free does not bring it
    # back, and nobody is taken off for a prefetch refused anyway
    arbiter, kernels = short_of_return(processes, 5)
    grower = arbiter.conns[processes[0]]
    prefetch(arbiter, grower, 6)
    [refused] = decided(arbiter, "prefetch refused")
    assert "no room to come back ahead of the cell" in refused["message"]
    assert grower.told[-1]["type"] == "deny"
    assert decided(arbiter, "suspend") == []
    assert [k.state for k in kernels[1:5]] == [books.PAUSED] * 4


def test_another_users_cell_is_decided_while_suspends_for_a_prefetchs_return_are_in_the_driver(processes):
    # the step toward the grower's own return is made outside the card's lock: user6's
    # cell, which fits beside it, is granted while the suspends are still in the driver,
    # where under the lock it waited for them
    arbiter, card, kernels = node(processes, short_contexts=3.5)
    kernels[0].paused_bytes = asyncio.run(card.read(CARD)).free + int(1.5 * CONTEXT)
    grower, other = arbiter.conns[processes[0]], arbiter.conns[processes[6]]
    checkpoint = arbiter.checkpoint
    checkpoint.held = threading.Event()
    told_meanwhile = []

    async def scenario():
        await arbiter.rooms.request(grower, 1, "prefetch")
        assert await asyncio.to_thread(checkpoint.entered.wait, 10), "no suspend for the return"
        await arbiter.rooms.request(other, 5, "run")
        await asyncio.wait_for(other.room_task, 5)
        told_meanwhile.extend(other.told)
        checkpoint.held.set()
        await grower.room_task
        if grower.ahead_task is not None:
            await grower.ahead_task

    asyncio.run(scenario())
    assert told_meanwhile == [{"type": "grant", "id": 5}]
    suspends = decided(arbiter, "suspend")
    assert sorted(d["server"] for d in suspends) == ["user1/", "user2/"], suspends
    assert {d["reason"] for d in suspends} == {"room ahead for user0/"}
    # the card looked at again after the step: the room user6's cell was granted meanwhile
    # (its growth to its 2 GiB budget) counts, and the return no longer fits
    [answer] = grower.told
    assert answer["type"] == "deny", answer
    assert "no room to come back ahead of the cell (674.00 MiB short)" in answer["message"], answer
    assert all(k.moving is None for k in kernels), [k.moving for k in kernels]


def test_room_ahead_off_refuses_a_prefetch_short_of_its_return(processes):
    arbiter, kernels = short_of_return(processes, 1.5)
    arbiter.config.room_ahead = False
    grower = arbiter.conns[processes[0]]
    prefetch(arbiter, grower, 2)
    assert grower.told[-1]["type"] == "deny"
    assert decided(arbiter, "suspend") == []
    assert [k.state for k in kernels[1:5]] == [books.PAUSED] * 4


def test_a_cell_that_asks_while_its_prefetch_is_decided_makes_its_own_room(processes):
    # the kernel's cell asks for room while its prefetch still makes room for its return:
    # no room ahead starts after the grant, and the cell's own request makes the rest
    arbiter, _ = short_of_return(processes, 1.5)
    grower = arbiter.conns[processes[0]]
    checkpoint = arbiter.checkpoint
    checkpoint.held = threading.Event()

    async def scenario():
        await arbiter.rooms.request(grower, 1, "prefetch")
        assert await asyncio.to_thread(checkpoint.entered.wait, 10), "no suspend for the return"
        await arbiter.rooms.request(grower, 2, "run")
        checkpoint.held.set()
        await grower.room_task

    asyncio.run(scenario())
    assert grower.ahead_task is None
    assert grower.told[0] == {"type": "grant", "id": 1}
    assert grower.told[-1] == {"type": "grant", "id": 2}
    assert {m["type"] for m in grower.told[1:-1]} <= {"wait"}  # its cell told what it waits for
    whats = [(d["what"], d.get("reason")) for d in arbiter.decisions if d["what"] in ("suspend", "prefetch")]
    assert whats[:3] == [("suspend", "room ahead for user0/")] * 2 + [("prefetch", None)], whats
    assert whats[3:], whats
    assert set(whats[3:]) == {("suspend", "room for user0/")}, whats


def suspended_grower(processes: list[int], short_contexts: float):
    """:func:`node` with the grower suspended: its context in the driver's checkpoint, off
    the card, and as much more free on it."""
    arbiter, card, kernels = node(processes[:6], short_contexts=short_contexts)
    grower = kernels[0]
    grower.state = books.SUSPENDED
    grower.checkpoint_bytes = card.held.pop(grower.pid)
    grower.checkpoint_need = {CARD: grower.checkpoint_bytes}
    grower.group, grower.group_ids = [grower.pid], [grower.identity]
    grower.resident = 0
    return arbiter, card, kernels


def test_a_suspended_kernels_room_ahead_is_made_beside_its_restore(processes):
    # the driver's restore lasts until a suspend ahead has entered the driver: made after
    # the restore, the room ahead kept the cell waiting for both, one after the other
    arbiter, _, kernels = suspended_grower(processes, short_contexts=1.5)
    grower = arbiter.conns[processes[0]]
    prefetch(arbiter, grower, 3)
    assert grower.told[0] == {"type": "grant", "id": 3}
    assert arbiter.checkpoint.beside, "the room ahead waited for the restore"
    [restored] = decided(arbiter, "restored")
    assert restored["server"] == "user0/"
    suspends = decided(arbiter, "suspend")
    assert len(suspends) == 2
    assert {d["reason"] for d in suspends} == {"room ahead for user0/"}
    assert kernels[0].state == books.ACTIVE
    assert kernels[0].checkpoint_bytes == 0


def test_a_kernel_whose_spill_is_under_way_is_not_suspended_until_it_ends(processes, tmp_path):
    # user1's paused data is on its way to disk (the background spill: the kernel has not
    # answered yet) when a prefetch makes room ahead: suspended then, the kernel would be
    # frozen in the middle of its spill, and whatever waited for the spill would wait for
    # its restore. It stays; the other three paused kernels go.
    arbiter, _, kernels = node(processes[:6], short_contexts=3.5)
    arbiter.checkpoint.together = 3
    tiering = arbiter.tiering
    tiering.disk = disk.DiskTier(tmp_path / "tier")
    spiller = kernels[1]
    spiller.host_bytes, spiller.disk_dir = GiB, tiering.disk.user_dir(spiller.uid)
    conn = arbiter.conns[spiller.pid]
    asked, answer = asyncio.Event(), asyncio.Event()

    async def ask(msg, timeout, sent=None):
        conn.asked.append(msg["type"])
        if msg["type"] == "spill":
            asked.set()
            await answer.wait()
        return {"ok": True, "message": "done", "released": 0}

    conn.ask = ask

    async def scenario():
        spilling = asyncio.ensure_future(tiering.spill(spiller))
        await asyncio.wait_for(asked.wait(), 10)
        await arbiter.rooms.prefetch(arbiter.conns[processes[0]], 1)
        await arbiter.conns[processes[0]].ahead_task
        answer.set()
        await spilling

    asyncio.run(scenario())
    suspends = decided(arbiter, "suspend")
    assert sorted(d["server"] for d in suspends) == ["user2/", "user3/", "user4/"], suspends
    assert conn.asked == ["spill"]
    assert spiller.state == books.PAUSED
    assert spiller.moving is None  # the spill over, it may move again


def test_another_users_cell_is_decided_while_the_suspends_ahead_are_in_the_driver(processes):
    # the room ahead's suspends are made outside the card's lock: user6's cell, which fits
    # beside them, is granted while they are still in the driver, not after them
    arbiter, _, _ = node(processes, short_contexts=6, idle_pid_seconds=400)
    arbiter.config.suspend_after = 30
    other = arbiter.conns[processes[6]]
    told_meanwhile, moving_meanwhile = [], {}

    async def during():
        await arbiter.rooms.request(other, 5, "run")
        await asyncio.wait_for(other.room_task, 5)
        told_meanwhile.extend(other.told)
        moving_meanwhile.update({k["server"]: k["moving"] for k in arbiter.snapshot()["kernels"]})

    steps_held(arbiter, arbiter.conns[processes[0]], during)
    assert told_meanwhile == [{"type": "grant", "id": 5}]
    # the books show the moves under way
    assert moving_meanwhile == {f"user{i}/": "suspend" if 1 <= i <= 4 else None for i in range(7)}
    suspends = decided(arbiter, "suspend")
    assert sorted(d["server"] for d in suspends) == ["user1/", "user2/", "user3/", "user4/"]


def test_a_cell_that_the_kernels_leaving_would_make_room_for_waits_for_them(processes):
    # user6's cell is short of less than the four contexts the room ahead is taking off the
    # card: it waits for them rather than pausing user5 (idle, 3 GiB), and is granted once
    # they are off
    arbiter, card, kernels = node(processes, short_contexts=6)
    arbiter.config.suspend_after = 30
    other = arbiter.conns[processes[6]]

    async def during():
        card.reserve += 3 * GiB  # the card fills meanwhile: user6's cell is short
        await arbiter.rooms.request(other, 5, "run")

    steps_held(arbiter, arbiter.conns[processes[0]], during)
    assert other.told[-1] == {"type": "grant", "id": 5}
    assert decided(arbiter, "pause") == []
    assert kernels[5].state == books.IDLE
    [queued] = decided(arbiter, "queued")
    assert "leaving the card" in queued["message"], queued


def test_a_kernel_that_asks_for_room_while_a_room_ahead_suspends_it_is_restored_after(processes):
    # user1 is among the suspends made ahead of the grower's cell when its own cell asks
    # for room: granted then, it would be suspended after its grant. Its room is decided
    # once the suspend is over: it is restored from the driver's checkpoint, then granted.
    arbiter, card, kernels = node(processes, short_contexts=6, idle_pid_seconds=400)
    arbiter.config.suspend_after = 30
    user1 = arbiter.conns[processes[1]]
    asked = []

    async def during():
        card.reserve -= 8 * GiB  # room enough for user1's cell
        await arbiter.rooms.request(user1, 9, "run")
        await asyncio.sleep(0.2)
        asked.extend(user1.told)
        await arbiter.rooms.prefetch(user1, 10)  # a prefetch of it meanwhile is refused

    steps_held(arbiter, arbiter.conns[processes[0]], during)
    assert all(m["type"] == "wait" for m in asked), asked  # not granted while its suspend was in the driver
    assert user1.told[-1] == {"type": "grant", "id": 9}
    denied = [m for m in user1.told if m.get("id") == 10]
    assert [m["type"] for m in denied] == ["deny"], denied
    assert "under way" in denied[0]["message"]
    whats = [d["what"] for d in arbiter.decisions if d.get("server") == "user1/"]
    assert whats.index("suspend") < whats.index("restored"), whats
    assert kernels[1].state == books.ACTIVE


def back_on_the_card(arbiter: Arbiter, kernel: books.Kernel) -> None:
    """``kernel``'s report that it is back and idle (its prefetch's return over)."""
    figures = {"resident": kernel.resident, "paused_bytes": 0, "host_bytes": 0, "resume_seconds": None}
    arbiter.sessions.state(kernel, {"state": "idle", **figures})


def test_a_prefetch_makes_its_room_ahead_beside_the_room_another_prefetch_holds(processes):
    # user0's prefetch finds its cell's room free (nobody to take off) and holds it; user6's
    # prefetch comes before user0's cell runs: that room is user0's, so user6's room ahead
    # suspends two paused kernels' contexts, and neither cell makes room as it starts. Seen
    # free by user6's prefetch, user0's room went to whichever cell ran first, and the
    # other made its room while its user waited.
    arbiter, _, kernels = node(processes, short_contexts=0)
    arbiter.config.room_held_seconds = 5.0  # holds are off by default
    second = kernels[6]  # 2 GiB budget, 1 GiB on the card; paused, 512 MiB to bring back
    second.state, second.paused_bytes, second.since = books.PAUSED, GiB // 2, time.monotonic() - 60
    prefetch(arbiter, arbiter.conns[processes[0]], 1)
    assert decided(arbiter, "suspend") == decided(arbiter, "pause") == []
    back_on_the_card(arbiter, kernels[0])
    assert kernels[0].holding() == 8 * GiB
    [books_entry] = [k for k in arbiter.snapshot()["kernels"] if k["server"] == "user0/"]
    assert books_entry["room_held"] == 8 * GiB
    prefetch(arbiter, arbiter.conns[processes[6]], 2)
    suspends = decided(arbiter, "suspend")
    assert [d["reason"] for d in suspends] == ["room ahead for user6/"] * 2, list(arbiter.decisions)
    back_on_the_card(arbiter, second)

    async def cells():
        for pid in (processes[6], processes[0]):
            await arbiter.rooms.request(arbiter.conns[pid], 3, "run")
            await arbiter.conns[pid].room_task

    asyncio.run(cells())
    for pid in (processes[0], processes[6]):
        assert arbiter.conns[pid].told[-1] == {"type": "grant", "id": 3}
    made_then = [d for d in arbiter.decisions if str(d.get("reason", "")).startswith("room for")]
    assert made_then == [], made_then
    assert kernels[0].room_held == 0
    assert kernels[0].granted == 8 * GiB


def test_a_hold_ends_with_its_time_or_as_its_kernel_leaves_and_room_held_seconds_0_makes_none(processes):
    arbiter, _, kernels = node(processes, short_contexts=0)
    arbiter.config.room_held_seconds = 0.2
    grower, conn = kernels[0], arbiter.conns[processes[0]]
    prefetch(arbiter, conn, 1)
    assert grower.holding() == 8 * GiB  # coming back
    back_on_the_card(arbiter, grower)
    assert grower.holding() == 8 * GiB
    wait_for(lambda: grower.holding() == 0, 5, "user0's hold to run out")
    # paused again before its cell ran: the hold goes with it, and does not come back with it
    grower.room_held, grower.room_held_until = 8 * GiB, time.monotonic() + 60
    figures = {"resident": CONTEXT, "paused_bytes": GiB, "host_bytes": GiB, "resume_seconds": None}
    arbiter.sessions.state(grower, {"state": "paused", **figures})
    assert grower.room_held == 0
    arbiter.config.room_held_seconds = 0  # the admin's setting: no hold at all
    arbiter.rooms._prefetched.clear()  # the per-user rate limit
    prefetch(arbiter, conn, 2)
    assert conn.told[-1] == {"type": "grant", "id": 2}
    assert grower.room_held == 0


@pytest.mark.parametrize("paused_between", [False, True], ids=["kept", "ended by a pause"])
def test_a_cell_that_begins_within_the_hold_keeps_the_held_room_until_its_request_is_decided(
    processes, paused_between
):
    # a hold the arbiter's pause ended (the books' state set by the move, no report) is
    # not carried into the grant of the cell that resumes the kernel within the hold's time
    arbiter, _, kernels = node(processes, short_contexts=0)
    arbiter.config.room_held_seconds = 5.0  # holds are off by default
    grower = kernels[0]
    prefetch(arbiter, arbiter.conns[processes[0]], 1)
    back_on_the_card(arbiter, grower)
    assert grower.holding() == 8 * GiB
    if paused_between:
        grower.state = books.PAUSED  # as moves.py sets the books on the arbiter's pause
    figures = {"resident": grower.resident, "paused_bytes": 0, "host_bytes": 0, "resume_seconds": None}
    arbiter.sessions.state(grower, {"state": "active", **figures})  # its cell began
    if paused_between:
        assert (grower.granted, grower.room_held) == (0, 0)
    else:
        assert (grower.granted, grower.room_held) == (8 * GiB, 0)
        assert books.promised([grower]) == 8 * GiB - grower.resident  # every room counts it now


def test_by_default_a_prefetch_holds_no_room_for_its_cell(processes):
    # room_held_seconds is 0 unless an admin sets it: measured at 12x, holds made more
    # suspends ahead and a longer tail (docs/design.md, the tenth try)
    arbiter, _, kernels = node(processes, short_contexts=0)
    prefetch(arbiter, arbiter.conns[processes[0]], 1)
    assert arbiter.conns[processes[0]].told[-1] == {"type": "grant", "id": 1}
    back_on_the_card(arbiter, kernels[0])
    assert (kernels[0].room_held, kernels[0].holding()) == (0, 0)
