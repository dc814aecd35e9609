"""Room on demand: a kernel's requests to run, answered by making room on its card.

Before a kernel runs code it asks for room (``{"type": "room"}``, :mod:`.protocol`).
Under its card's lock the arbiter reads the card, and while the kernel is short
(:func:`.books.shortfall`) takes idle kernels off it in the order of
:func:`.books.victims` (:meth:`.moves.Moves.take_off`); it then grants the request, or
queues it with a message the cell shows until room appears or ``queue_timeout``
passes. A suspended kernel is restored outside the lock, its room held for it. A
``prefetch`` (the user is about to run a cell) is answered at once, granted only where
the card has room once kernels idle past their ``idle_seconds`` are paused for it; once
granted, the room its cell will need is made while the kernel comes back
(:func:`.books.room_ahead`). Every wait is told to the cell as it goes, at least once a
second (:func:`said_while`).

A kernel has at most one request decided and one waiting; a newer one replaces the
waiting one (:meth:`Rooms.request`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from jupyter_vgpu import failpoints
from jupyter_vgpu.nvml import NVMLUnavailable
from jupyter_vgpu.units import format_bytes

from . import books, protocol, tiers
from .books import ACTIVE, EVEN, PAUSED, SUSPENDED, Kernel, Reason
from .cards import Reading
from .enforcement import REFUSAL_SECONDS

if TYPE_CHECKING:
    from .arbiter import Arbiter
    from .sessions import Connection

T = TypeVar("T")
log = logging.getLogger("jupyter_vgpu.node")


async def said_while(
    work: Awaitable[T], tell: Callable[[str], Awaitable[None]], what: str, every: float = 1.0
) -> T:
    """Await ``work`` and return its result, telling ``what`` at once and then every
    ``every`` seconds until it is done, with the seconds so far ("what (3 s)").

    Raises:
        Exception: whatever ``work`` raised.
    """
    task = asyncio.ensure_future(work)
    t0 = time.monotonic()
    try:
        await tell(what)
        while True:
            done, _ = await asyncio.wait({task}, timeout=every)
            if done:
                return task.result()
            await tell(f"{what} ({time.monotonic() - t0:.0f} s)")
    except asyncio.CancelledError:
        task.cancel()  # as if ``work`` had been awaited directly
        raise


class _Leaving(Exception):
    """A kernel asks for room while a room ahead takes it off the card (:meth:`Rooms.room`)."""


class _Waiting(str):
    """Why a cell waits with nobody taken off the card for it, a note of
    :meth:`Rooms.make_room`: said as it is, with no word of the memory needed."""


class _Prefetch(NamedTuple):
    """What :meth:`Rooms._prefetch_locked` decided: a step toward the kernel's return to
    make (``step``), the driver's restore to make (``restore``, the kernel's state before,
    ``was``), or neither: the prefetch was answered."""

    step: list | None = None
    restore: bool = False
    was: str | None = None


class _NotAdmitted(_Waiting):
    """No room made for the cell would help: the running cells' budgets and its own pass
    the card (:func:`books.admission_short`)."""


class _ForACell(_Waiting):
    """The cell's room would need a paused kernel suspended, and it waits for a cell
    running on its card to end instead (``ArbiterApp.suspend_wait``)."""


class Rooms:
    """The requests for room of the arbiter's kernels.

    Args:
        arbiter: the :class:`~.arbiter.Arbiter` (its cards, their locks, its settings:
            ``queue_timeout``, ``suspend_after``, ``watermark``, ``prefetch_interval``).
    """

    def __init__(self, arbiter: Arbiter):
        self.arbiter = arbiter
        self._prefetched: dict[str, float] = {}  # user -> monotonic seconds of their last prefetch

    async def request(
        self,
        conn: Connection,
        rid: int,
        purpose: str,
        nbytes: int = 0,
        answer_to: Connection | None = None,
        cell: bool = False,
    ) -> None:
        """Take a kernel's request ``rid`` for room: decided after the one being decided,
        replacing (and denying) one that waits its turn already. ``nbytes``: for ``grow``,
        the bytes of the allocation that found no room; ``answer_to``: the connection its
        answers go to (the kernel's grow channel), None: the kernel's own; ``cell``: the
        room is for a cell the user ran (protocol version 6), which takes turns
        (:mod:`.turns`)."""
        if conn.room_next is not None:  # one waits for its turn already: this one replaces it
            why = "a newer request for room from this kernel replaced this one"
            rid_was, _, _, to, _ = conn.room_next
            await self.arbiter.sessions.send(to or conn, {"type": "deny", "id": rid_was, "message": why})
        conn.room_next = (rid, purpose, nbytes, answer_to, cell)
        if purpose != "prefetch":  # its cell makes its own room from here (:meth:`_take_ahead`)
            conn.ahead_stop = True
        if conn.room_task is None or conn.room_task.done():
            conn.room_task = asyncio.ensure_future(self._run(conn))

    async def _run(self, conn: Connection) -> None:
        """A kernel's requests for room, one at a time (a kernel runs one message at a
        time; one asked while another is decided waits its turn, and at most one waits)."""
        while conn.room_next is not None:
            (rid, purpose, nbytes, answer_to, cell), conn.room_next = conn.room_next, None
            try:
                turns = self.arbiter.turns
                if purpose == "prefetch":
                    await self.prefetch(conn, rid)
                elif purpose == "grow":
                    await self.room(conn, rid, purpose, nbytes, answer_to)
                elif turns.takes_turns(conn.kernel, cell):
                    reply = answer_to or conn
                    async with turns.turn(conn.kernel, self._teller(reply, rid)) as wanted:
                        if wanted:
                            await self.room(conn, rid, purpose, nbytes, answer_to)
                        else:  # nobody waits for the answer: no room is made for it
                            why = "the cell was given up while it waited its turn"
                            await self.arbiter.sessions.send(
                                reply, {"type": "deny", "id": rid, "message": why}
                            )
                    turns.granted(conn.kernel, True)  # it waited its turn: nothing to check
                else:
                    await self.room(conn, rid, purpose, nbytes, answer_to)
                    turns.granted(conn.kernel, cell)
            except Exception as e:  # a fault of the arbiter's own: said at once, not left to patience
                await self._failed(conn, rid, purpose, e, answer_to)

    async def _failed(
        self, conn: Connection, rid: int, purpose: str, error: Exception, answer_to: Connection | None = None
    ) -> None:
        """Answer request ``rid`` whose decision raised ``error``: ``failed``, naming it
        (the kernel goes on as without an arbiter, at once: before, it heard nothing and
        waited out its patience, 60 s), as a decision and in the log with its traceback."""
        a = self.arbiter
        why = f"{type(error).__name__}: {error}"
        log.error("deciding room (%s) for pid %d failed: %s", purpose, conn.pid, why, exc_info=error)
        key = conn.kernel.server.key if conn.kernel is not None else None
        a.decide("room failed", server=key, pid=conn.pid, message=why)
        message = f"the node arbiter could not decide this request ({why})"
        await a.sessions.send(answer_to or conn, {"type": "failed", "id": rid, "message": message[:4000]})

    async def prefetch(self, conn: Connection, rid: int) -> None:
        """Bring a paused or suspended kernel back ahead of a cell its user is about to run
        (they opened, focused or edited its notebook): at once, or not at all. Kernels idle
        past their ``idle_seconds`` are paused first, down to the watermark
        (:meth:`_pause_owed`); then it is granted where it fits beside what running cells
        were promised (:func:`books.prefetch_short`), once per ``prefetch_interval`` per
        user (all their servers); otherwise denied, and the cell asks for its room when it
        runs. Once granted, the room its cell will need is made while it comes back
        (:func:`books.room_ahead`, :meth:`_take_ahead`): what the cell would otherwise
        wait for after its user pressed run. Where the kernel's own return does not fit,
        one step of paused kernels' suspends may be made for it (:meth:`_return_step`),
        outside the card's lock as the room ahead's steps are, and the card is looked at
        again: held under the lock, such a step of four suspends (1.19 s) kept another
        user's cell waiting 1.16 s for a pause of 0.08 s (48 MLP sessions, seed 7 at
        e44a354, ``benchmarks/results/sessions-h100.json``)."""
        a = self.arbiter
        kernel = conn.kernel
        uuid = kernel.slice.gpu_uuid
        now = time.monotonic()
        conn.ahead_stop = False  # set again by a request of its cell's, from now on

        async def deny(outcome: str, message: str) -> None:
            a.metrics.prefetches.labels(gpu=uuid, outcome=outcome).inc()
            a.decide("prefetch refused", server=kernel.server.key, pid=kernel.pid, message=message)
            await a.sessions.send(conn, {"type": "deny", "id": rid, "message": message})

        last = self._prefetched.get(kernel.server.user)
        if last is not None and now - last < a.config.prefetch_interval:
            await deny("too soon", f"one prefetch per {a.config.prefetch_interval:g} s per user")
            return
        stepped = False  # a step toward its return made already: one at most
        while True:
            decided = await self._prefetch_locked(conn, rid, deny, now, stepped)
            if not decided.step:
                break
            stepped = True
            await self._take_step(kernel, decided.step)
        if not decided.restore:
            return  # answered under the card's lock
        was = decided.was
        # outside the card's lock, its room held
        ok, why = await a.moves.restore(kernel)
        if not ok:
            conn.ahead_stop = True  # nothing came back: no room is made for its cell ahead of it
            kernel.state, kernel.granted = was, 0
            kernel.end_hold()
            await a.notify()
            await deny("no room", why or "the restore failed")
            return
        await self._grant_prefetch(conn, rid)

    async def _prefetch_locked(
        self, conn: Connection, rid: int, deny, now: float, stepped: bool
    ) -> _Prefetch:
        """The decision of :meth:`prefetch` under the card's lock (``deny``: its refusal,
        ``now``: when it was asked, ``stepped``: a step toward the kernel's return was made
        already): answered here (refused, or granted where the kernel comes back from host
        memory itself), a step to make first, or the driver's restore to make."""
        a = self.arbiter
        kernel = conn.kernel
        uuid = kernel.slice.gpu_uuid
        async with contextlib.AsyncExitStack() as locked:
            # a slice of several cards: every card's lock, in the order room takes them
            for card in sorted(kernel.slice.gpu_uuids):
                await locked.enter_async_context(a.locks[card])
            if kernel.moving in ("pause", "suspend"):  # a room ahead takes it off the card now
                await deny("leaving", f"this kernel's {kernel.moving} is under way: its cell brings it back")
                return _Prefetch()
            if kernel.moving == EVEN:  # the driver holds it a second: its cell waits for that
                await deny("evening", "the driver is taking this kernel's context off the GPU and back")
                return _Prefetch()
            # its state may read active already: a kernel reports so as it starts coming back
            held = kernel.state == SUSPENDED or kernel.checkpoint_bytes > 0
            if not held and kernel.state != PAUSED and kernel.paused_bytes == 0:
                await deny("not away", "nothing to bring back: none of the kernel's memory is off the GPU")
                return _Prefetch()
            # each card by what the kernel brings back to it (a slice of several: its share)
            free: dict[str, int] = {}
            later: list = []  # pauses owed to the watermark that its return does not need
            for card, index in zip(kernel.slice.gpu_uuids, kernel.slice.gpu_indices, strict=True):
                try:
                    reading = await a.read(card)
                except NVMLUnavailable as e:
                    await deny("card unreadable", f"GPU {index} does not answer: {e}")
                    return _Prefetch()
                others = [k for k in a.on_card(card) if k is not kernel]
                # kernels idle past their idle_seconds go, down to the watermark, even where
                # the prefetch fits (the background look leaves them while a cell runs); made
                # now only where its return needs them, else after the grant (_pause_owed)
                owed = self._owed(kernel, card, reading, others)
                short = books.prefetch_short(kernel, reading.free, others, card)
                if owed and short > 0:
                    if await self._pause_owed(owed):
                        reading = await a.read(card)
                        short = books.prefetch_short(kernel, reading.free, others, card)
                    owed = []
                later += owed
                free[card] = reading.free
                if short > 0 and a.config.room_ahead and not kernel.slice.more_gpus and not stepped:
                    step = self._return_step(kernel, card, others, short)
                    if step:  # made outside the card's lock; then the card is looked at again
                        return _Prefetch(step=step)
                if short > 0:
                    where = f" on GPU {index}" if kernel.slice.more_gpus else ""
                    await deny(
                        "no room",
                        f"no room to come back ahead of the cell ({format_bytes(short)} short{where})",
                    )
                    return _Prefetch()
            self._prefetched[kernel.server.user] = now
            # what the owed pauses made after the grant will free counts as free for the cell's
            # room below (what they hold, as in books.covering)
            pending = sum(books.held(v, uuid) for v, _ in later if uuid in v.slice.gpu_uuids)
            if later:  # marked here, under the lock: no room or other move takes them meanwhile
                for victim, _ in later:
                    victim.moving = "pause"
                a.spawn(self._pause_owed(later, claimed=True))
            free[uuid] += pending
            # the cell's room, decided on the card as it is before the kernel comes back
            # (each card of a slice of several: the cell's own request makes theirs)
            short, ahead = 0, []
            if self.on_demand(conn):  # the room ahead of its cell: what the cell starts with
                kernel.asks = books.start_asks(kernel, a.config.grant_margin, uuid)
            if a.config.room_ahead:
                others = [k for k in a.on_card(uuid) if k is not kernel]
                if a.config.release_first and not kernel.slice.more_gpus:
                    free[uuid] = await self._release_ahead(kernel, uuid, free[uuid], others, pending)
                short, ahead = books.room_ahead(
                    kernel, free[uuid], others, a.config.suspend_after, time.monotonic(), uuid
                )
                ahead = self._still_to_take(ahead, kernel)
                # its cell's room held for it (:meth:`.books.Kernel.holding`; a slice of one
                # card, as the room ahead: its growth is that card's)
                if a.config.room_held_seconds > 0 and not kernel.slice.more_gpus:
                    kernel.hold_room(books.growth(kernel, free[uuid], others, uuid))
            # counted as running until it reports itself idle: what it brings back is promised
            was = kernel.state
            kernel.granted = kernel.resident + kernel.paused_bytes + kernel.checkpoint_bytes
            kernel.state, kernel.since = ACTIVE, time.monotonic()
            if not (held and a.checkpoint is not None):
                await self._grant_prefetch(conn, rid)  # it comes back from host memory itself, now
                self._ahead(conn, uuid, ahead, short)  # meanwhile
                return _Prefetch()
            # the room ahead begins beside the driver's restore (its steps wait for this lock):
            # after it, the restore (0.76-0.89 s) was on the cell's path too; two prefetched
            # kernels' cells waited 2 s for the suspends ahead that began once it ended (48 MLP
            # sessions, seed 7 at 76fac3b, ``benchmarks/results/sessions-h100.json``)
            self._ahead(conn, uuid, ahead, short)
            return _Prefetch(restore=True, was=was)

    async def _release_ahead(
        self, kernel: Kernel, uuid: str, free: int, others: list[Kernel], pending: int = 0
    ) -> int:
        """With ``ArbiterApp.release_first``, for a granted prefetch of ``kernel`` (card
        ``uuid``'s lock held, ``free`` bytes free on it): where the cached blocks of idle
        kernels cover its cell's room (:func:`books.room_ahead`'s shortfall, the rooms
        other prefetches hold counted), they are given back now (:meth:`_release`),
        kernels idle within their ``idle_seconds`` among them: a release takes nobody off
        the card, where the room ahead pauses none of those. Returns the card's free bytes
        after (read again, plus ``pending``: what pauses under way will free, counted in
        ``free`` too), or ``free`` where nobody was asked."""
        short = books.shortfall(kernel, free, others, uuid, holds=True, now=time.monotonic())
        if not await self._release(kernel, uuid, self._order(kernel, others), short, Reason.AHEAD):
            return free
        return (await self.arbiter.read(uuid)).free + pending

    async def _release(
        self, kernel: Kernel, uuid: str, order: list, short: int, reason: Reason, tell=None, notes=None
    ) -> bool:
        """Ask the idle kernels of ``order`` (:meth:`_order`) whose cached blocks cover
        ``short`` bytes on card ``uuid`` (:func:`books.releases`) to give them back for
        ``kernel``'s room (:meth:`.moves.Moves.release`, ``reason``: its cell's or the room
        ahead of it), milliseconds each; ``tell`` hears each as it starts, ``notes`` why one
        gave nothing. Whether anyone was asked: the card is then the caller's to read again."""
        a = self.arbiter
        asked = books.releases(order, short, uuid)
        for victim in asked:
            if tell is not None:
                await tell(
                    f"making room on GPU {kernel.slice.gpu_index}: {victim.server.key} gives back "
                    f"its cached memory, {format_bytes(short)} still to free"
                )
            await a.moves.release(victim, kernel.server.key, notes, reason)
        return bool(asked)

    def _return_step(self, kernel: Kernel, uuid: str, others: list[Kernel], short: int) -> list:
        """For a prefetch of ``kernel`` that is ``short`` bytes short of coming back to card
        ``uuid`` (its lock held; :func:`books.prefetch_short`): one step of the room ahead
        (:meth:`_head_step`) among the victims it may take (:func:`books.covering`: paused
        kernels' contexts, kernels idle past their ``idle_seconds``), its victims marked
        ``moving`` (no other room or background move takes them), ``[(victim, action)]``
        for :meth:`_take_step` to make outside the lock; ``[]`` where what that step's
        victims hold does not cover ``short``: nobody moves for a prefetch that would be
        refused anyway, and the cell makes the room when it runs.

        Refused instead, 10 of 48 prefetches on 48 MLP sessions left their cell to bring
        the kernel back after its user pressed run (0.4 to 2 GiB short, a few paused
        kernels' contexts; seed 11 at 76fac3b, ``benchmarks/results/sessions-h100.json``)."""
        a = self.arbiter
        order = books.covering(kernel, short, others, a.config.suspend_after, time.monotonic(), uuid)
        order = self._still_to_take(order, kernel)
        if not order:
            return []
        step = self._head_step(order, short, uuid)
        if sum(books.held(victim, uuid) for victim, _ in step) < short:
            return []
        for victim, action in step:
            victim.moving = action
        return step

    async def _take_step(self, kernel: Kernel, step: list) -> list[bool]:
        """Take ``step`` (``[(victim, action)]``, marked ``moving`` under their card's lock)
        off the card ahead of ``kernel``'s cell or return, together, the lock let go: a
        cell that asks meanwhile is decided at once (:meth:`make_room` waits for these
        victims only where what they hold covers what it lacks), and is woken once they
        are off. Returns whether each left the card (no trim or spill of host memory is
        made for them: ``host_first``)."""
        a = self.arbiter
        moved = await asyncio.gather(
            *(
                a.moves.take_off(
                    victim, action, Reason.AHEAD, for_whom=kernel.server.key, host_first=[], claimed=True
                )
                for victim, action in step
            )
        )
        await a.notify()  # a cell waiting for these kernels to leave (:meth:`make_room`)
        return moved

    def _still_to_take(self, order: list, kernel: Kernel) -> list:
        """``order`` (``[(victim, action)]``, a room ahead of ``kernel``'s cell) less the
        victims a room ahead leaves: one whose state changed since it was chosen (it ran,
        or was taken off for another), one that declined a moment ago, one with a move
        under way (``moving``: a spill, say), one whose kernel left, every suspend where the
        driver's checkpoint is not available, and every suspend while a cell other than
        ``kernel``'s runs on the victim's card where ``ArbiterApp.suspend_wait`` is set (a
        cell that has started waits for such a cell to end before suspending anyone; one
        that has not started does not suspend beside it either)."""
        a = self.arbiter
        now = time.monotonic()
        wanted = {"pause": books.IDLE, "suspend": books.PAUSED}
        waits = a.config.suspend_wait > 0
        return [
            (victim, action)
            for victim, action in order
            if victim.state == wanted[action]
            and not victim.declined(action, now, REFUSAL_SECONDS)
            and victim.moving is None
            and a.conns.get(victim.pid) is not None
            and (action == "pause" or a.checkpoint is not None)
            and not (
                action == "suspend"
                and waits
                and books.running_cells([k for k in a.on_card(victim.slice.gpu_uuid) if k is not kernel])
            )
        ]

    def _ahead(self, conn: Connection, uuid: str, ahead: list, short: int) -> None:
        """Start making the room ahead of ``conn``'s next cell (:meth:`_take_ahead`) as its
        own task (``conn.ahead_task``), so that the kernel's next request, its cell's, is
        taken at once rather than after it; none where its cell has asked for room already
        (``conn.ahead_stop``)."""
        if ahead and not conn.ahead_stop:
            conn.ahead_task = asyncio.ensure_future(self._take_ahead(conn, uuid, ahead, short))

    async def _grant_prefetch(self, conn: Connection, rid: int) -> None:
        a, kernel = self.arbiter, conn.kernel
        a.decide("prefetch", server=kernel.server.key, pid=kernel.pid, bytes=kernel.paused_bytes)
        a.metrics.prefetches.labels(gpu=kernel.slice.gpu_uuid, outcome="granted").inc()
        await a.sessions.send(conn, {"type": "grant", "id": rid})

    async def _take_ahead(self, conn: Connection, uuid: str, ahead: list, short: int) -> None:
        """Take ``ahead`` (:func:`books.room_ahead`) off card ``uuid`` for the cell of the
        prefetched kernel on ``conn``: one step at a time (the suspends at the head of what
        is left, together, as :meth:`_suspends_together` finds them, or one victim alone).
        Each step is decided under the card's lock, its victims marked ``moving`` there (no
        other room or background move takes them), and made once the lock is let go: a
        cell that asks for room meanwhile (another kernel's, or this kernel's own) is
        decided at once, waiting for these victims only where what they hold covers what
        it lacks (:meth:`make_room`). The room ahead stops once the kernel's own cell has
        asked for room (``conn.ahead_stop``: that request makes whatever is still missing;
        set too where the kernel's restore failed) or the kernel left. A victim whose state
        changed since (it ran, or was taken off for another), or that declined a moment
        ago, stays, and so does one whose pause waits for host memory (no trim or spill for
        a cell that has not started). ``short``: the bytes the cell's room lacked, bytes. A
        fault here is a decision (``room ahead failed``), never the prefetch's: the kernel
        was granted its return already, and its cell asks for whatever room is still
        missing.

        Made in the prefetch's own request, under the lock, the room ahead kept every other
        cell of the card waiting: on 48 MLP sessions, a prefetched kernel's cell waited
        4.2 s behind the three suspends made ahead of a cell of another user that had not
        started (seed 11 at 76fac3b, ``benchmarks/results/sessions-h100.json``). Made a step
        per hold of the lock, under it, a step of four suspends (1.27 s) still kept another
        user's cell waiting 0.64 s for a room it could make in 0.07 s (seed 11 at 777869e).
        """
        a, kernel = self.arbiter, conn.kernel
        order, left = list(ahead), short
        try:
            while left > 0 and not conn.ahead_stop and a.conns.get(kernel.pid) is conn:
                async with a.locks[uuid]:
                    if conn.ahead_stop:  # its cell asked while this step waited for the card
                        return
                    order = self._still_to_take(order, kernel)
                    if not order:
                        return
                    step = self._head_step(order, left, uuid)
                    del order[: len(step)]
                    freed = sum(books.held(victim, uuid) for victim, _ in step)
                    for victim, action in step:  # theirs: no other room or background move takes them
                        victim.moving = action
                # outside the card's lock: a cell that asks meanwhile is decided at once
                if any(await self._take_step(kernel, step)):
                    left -= freed
        except Exception as e:
            log.error("making room ahead of %s's cell failed", kernel.server.key, exc_info=e)
            a.decide(
                "room ahead failed",
                server=kernel.server.key,
                pid=kernel.pid,
                message=f"{type(e).__name__}: {e}",
            )

    def _owed(self, kernel: Kernel, card: str, reading: Reading, others: list[Kernel]) -> list:
        """For a prefetch of ``kernel`` to ``card`` (its lock held, ``reading`` just taken,
        ``others`` its other kernels): the kernels idle past their slice's ``idle_seconds``
        to pause until the card, counting the prefetch and the running cells' promises, is at
        its watermark (:func:`books.prefetch_owed`), ``[(victim, "pause")]``, less those that
        declined a moment ago or have a move under way. The background look pauses those
        only while no cell runs on the card (:func:`books.quiet`); where many users share a
        card one always does, and those kernels kept the card full. A prefetch runs seconds
        before its cell, which would take them off itself (:meth:`make_room`), and its user
        waits in the meantime: 28 of 44 transformer sessions' cells found their kernel
        paused, their prefetch refused for room such kernels held
        (``benchmarks/results/sessions-h100.json``). Pauses only, never a suspend, and
        nobody within their ``idle_seconds``."""
        now = time.monotonic()
        watermark = self.arbiter.config.watermark
        owed = books.prefetch_owed(kernel, reading.used, reading.total, others, watermark, now, card)
        return [
            (v, action)
            for v, action in owed
            if v.moving is None and not v.declined(action, now, REFUSAL_SECONDS)
        ]

    async def _pause_owed(self, owed: list, claimed: bool = False) -> bool:
        """Pause ``owed`` (:meth:`_owed`) one after another; a kernel whose pause waits for
        host memory to be made stays. Returns whether any left the card.

        Where the prefetch fits without them, they are made after its grant, outside the
        card's lock (``claimed``: marked ``moving`` under it, so that no room or other move
        takes them meanwhile; each mark goes as its move ends): made before it, under the
        lock, the prefetch waited for them, up to nine pauses and 7.9 s where their host
        memory was pinned anew, and a cell sent meanwhile waited for its kernel's return
        (2.35 s for one of seed 11's, 48 MLP sessions at f922f59,
        ``benchmarks/results/sessions-h100.json``)."""
        a = self.arbiter
        moved = False
        for i, (victim, action) in enumerate(owed):
            try:
                moved |= await a.moves.take_off(victim, action, Reason.IDLE, host_first=[], claimed=claimed)
            except BaseException as e:
                if not claimed:
                    raise  # the prefetch's own request: it answers with the fault
                for rest, _ in owed[i + 1 :]:  # left for the next look, their marks taken off
                    rest.moving = None
                if not isinstance(e, Exception):
                    raise  # cancelled: the arbiter stops
                # a task of its own, after the grant: nobody else would hear of it
                log.exception("pausing %s for the watermark failed", victim.server.key)
                a.decide(
                    "pause failed",
                    server=victim.server.key,
                    pid=victim.pid,
                    message=f"{type(e).__name__}: {e}",
                )
                break
        if claimed and moved:
            await a.notify()  # a room request waiting for them to leave
        return moved

    def _teller(self, reply: Connection, rid: int) -> Callable[[str], Awaitable[None]]:
        """``tell(message)``: what request ``rid`` waits for now, sent to ``reply`` (a
        ``wait`` answer, shown in the cell's output)."""

        async def tell(message: str) -> None:
            await self.arbiter.sessions.send(reply, {"type": "wait", "id": rid, "message": message})

        return tell

    def on_demand(self, conn: Connection) -> bool:
        """Whether the kernel on ``conn`` is granted its growth on demand: the node's
        ``grant_on_demand`` is on and the kernel asks for room to grow (protocol version 4,
        as its hello said); other kernels are granted their whole budget."""
        version = (conn.hello or {}).get("version", 1)
        return bool(self.arbiter.config.grant_on_demand) and version >= protocol.GROW_VERSION

    async def room(
        self, conn: Connection, rid: int, purpose: str, nbytes: int = 0, answer_to: Connection | None = None
    ) -> None:
        """Answer request ``rid`` of the kernel on ``conn`` (``purpose``: ``run``,
        ``resume``, ``restore`` or ``grow``): grant it once the card has room for the
        kernel, making it (:meth:`make_room`) and restoring the kernel from the driver's
        checkpoint where the driver holds it; deny it after ``queue_timeout`` seconds.

        Where growth is granted on demand (:meth:`on_demand`), a starting cell is granted
        what :func:`books.start_asks` says, and admitted only where the running cells'
        budgets fit the card (:func:`books.admission_short`). ``grow``: the kernel's running
        cell met no room for an allocation of ``nbytes`` bytes; its grant is raised
        (:func:`books.grow_asks`) and the room made as for a cell, the kernel's state left
        as it is; a kernel not running a cell is denied at once. Every answer goes to
        ``answer_to`` where given (the kernel's grow channel), else to ``conn``."""
        failpoints.hit("arbiter.room")
        a = self.arbiter
        kernel = conn.kernel
        uuid = kernel.slice.gpu_uuid
        t0 = time.monotonic()
        deadline = t0 + a.config.queue_timeout
        # ArbiterApp.suspend_wait: until then, no suspend for this cell where another runs;
        # over a second before the request would be denied (queue_timeout)
        suspends_from = min(t0 + a.config.suspend_wait, deadline - 1.0)
        told = False
        growing = purpose == "grow"
        admit = not growing and self.on_demand(conn)
        reply = answer_to or conn
        tell = self._teller(reply, rid)

        if growing:
            if kernel.state != ACTIVE:
                why = f"this kernel runs no cell (it is {kernel.state}): nothing to grow"
                await a.sessions.send(reply, {"type": "deny", "id": rid, "message": why})
                return
            kernel.asks = books.grow_asks(kernel, nbytes, a.config.grant_margin, uuid)
        while True:
            if a.conns.get(conn.pid) is not conn:
                return  # the kernel left: nobody to make room for
            notes: list[str] = []  # why victims stayed where they are
            host_first: list[tuple[Kernel, int]] = []  # victims whose pause waits for host memory
            leaving = None  # this kernel's own pause or suspend, made ahead of another's cell
            try:
                async with contextlib.AsyncExitStack() as locked:
                    # a slice of several cards: room on each, under every card's lock (taken in
                    # one order, so two such kernels never wait on each other), in one decision
                    for card in sorted(kernel.slice.gpu_uuids):
                        await locked.enter_async_context(a.locks[card])
                    # a room ahead is taking it off the card, outside the lock: decided once it
                    # is off (a grant now would meet a suspend made after it)
                    if kernel.moving in ("pause", "suspend", EVEN):
                        leaving = kernel.moving
                        raise _Leaving
                    if admit:  # what it holds and brings back, as it is now, and the margin
                        kernel.asks = books.start_asks(kernel, a.config.grant_margin, uuid)
                    asked = (tell, notes, host_first, admit, time.monotonic() >= suspends_from)
                    short, reading = await self.make_room(kernel, uuid, *asked)
                    for card in kernel.slice.gpu_uuids[1:]:
                        more = await self.make_room(kernel, card, *asked)
                        short = max(short, more[0])
                    # the kernel's word (``restore``) or the books: whichever says the driver holds
                    # it, the driver is asked (a kernel reports itself active as soon as its cell
                    # starts, before its room)
                    held = purpose == "restore" or kernel.state == SUSPENDED
                    restoring = short <= 0 and held and a.checkpoint is not None
                    if short <= 0:  # its room is its own from here: a kernel running, as the books see it
                        was = kernel.state
                        others = [k for k in a.on_card(uuid) if k is not kernel]
                        kernel.granted = books.growth(kernel, reading.free, others, uuid)
                        kernel.end_hold()  # what its prefetch held is in its grant now
                        if not growing:
                            kernel.state, kernel.since = ACTIVE, time.monotonic()
            except _Leaving:
                if leaving == EVEN:
                    await tell("waiting for the driver to bring this kernel's context back (about a second)")
                else:
                    await tell(f"waiting for this kernel's {leaving}, made ahead of another cell, to end")
                await a.wait_for_change(1.0)
                continue
            except NVMLUnavailable as e:  # the card stopped answering: the kernel waits, told why
                message = f"GPU {kernel.slice.gpu_index} does not answer: {e}; waiting for it"
                if time.monotonic() >= deadline:
                    a.decide("denied", server=kernel.server.key, gpu=uuid, message=message)
                    await a.sessions.send(reply, {"type": "deny", "id": rid, "message": message})
                    return
                await tell(message)
                await a.wait_for_change(1.0)
                continue
            if restoring:
                # outside the card's lock: a restore that hangs holds up no other kernel. A word
                # each second while the driver restores (tens of seconds for tens of GiB): the
                # cell is never silent, and the kernel never takes the silence for a hung arbiter
                ok, why = await said_while(
                    a.moves.restore(kernel), tell, "restoring this kernel from the driver's checkpoint"
                )
                if not ok:
                    kernel.state, kernel.granted = was, 0  # as it was, its room given back
                    await a.notify()
                if ok is None:  # NVML shows less free than the restore needs: wait for it
                    short = 1
                    notes.append(why)
                elif not ok:
                    await a.sessions.send(reply, {"type": "deny", "id": rid, "message": why})
                    return
            if short > 0 and host_first and time.monotonic() < deadline:
                # outside the card's lock: trims and spills (seconds for gigabytes) hold up
                # no other kernel's room on this card; then the card is looked at again
                # a word each second meanwhile: the cell's kernel takes a silence of a minute
                # for a dead arbiter and runs without one (a cell waited 60 s for a spill)
                made = [
                    await said_while(
                        a.tiering.host_room(victim, need, tell),
                        tell,
                        f"making host memory for {victim.server.key} to leave GPU {kernel.slice.gpu_index}",
                    )
                    is None
                    for victim, need in host_first
                ]
                if any(made):
                    continue  # else it waits as any request does, saying why (notes)
            if short <= 0:
                if kernel.tier in ("host", "disk"):
                    where = "disk" if kernel.tier == "disk" else "host memory"
                    back = format_bytes(kernel.paused_bytes)
                    await tell(f"room granted: bringing {back} back from {where}")
                waited = time.monotonic() - t0
                if growing:
                    a.decide(
                        "grown", server=kernel.server.key, pid=kernel.pid, gpu=uuid, bytes=nbytes,
                        granted=kernel.granted, seconds=round(waited, 3),
                    )  # fmt: skip
                    a.metrics.grow_wait.labels(gpu=uuid).observe(waited)
                else:
                    a.metrics.queue_wait.labels(gpu=uuid).observe(waited)
                await a.sessions.send(reply, {"type": "grant", "id": rid})
                failpoints.hit("arbiter.grant")
                return
            running = [k for k in a.on_card(uuid) if k.state == ACTIVE and k is not kernel]
            if notes and isinstance(notes[-1], _Waiting):
                message = f"waiting on GPU {kernel.slice.gpu_index}: {notes[-1]}"
            else:
                message = (
                    f"waiting for GPU memory on GPU {kernel.slice.gpu_index}: {len(running)} session(s) "
                    f"running, {format_bytes(short + reading.free)} needed, {format_bytes(reading.free)} free"
                )
                if notes:
                    message += f"; {notes[-1]}"
            if time.monotonic() >= deadline:
                a.decide("denied", server=kernel.server.key, gpu=uuid, message=message)
                await a.sessions.send(
                    reply,
                    {
                        "type": "deny",
                        "id": rid,
                        "message": f"no room on the GPU after {a.config.queue_timeout:.0f} s ({message})",
                    },
                )
                return
            if not told:
                a.decide("queued", server=kernel.server.key, gpu=uuid, message=message)
                told = True
            await tell(message)
            # a cell waiting to be let suspend (suspend_wait) looks again as its wait ends
            until = suspends_from - time.monotonic()
            await a.wait_for_change(min(1.0, until) if until > 0 else 1.0)

    async def make_room(
        self,
        kernel: Kernel,
        uuid: str,
        tell=None,
        notes=None,
        host_first=None,
        admit: bool = False,
        suspends: bool = True,
    ) -> tuple[int, Reading]:
        """Pause or suspend idle kernels until ``kernel`` fits; returns what is still short
        (bytes) and the card's last reading. ``await tell(message)`` hears what is being
        done and why, as it starts; ``notes`` gets why victims stayed; ``host_first`` the
        victims whose pause waits for host memory to be made (:meth:`.moves.Moves.take_off`).
        ``admit``: growth is granted on demand, and the kernel waits, nobody taken off the
        card for it, while the running cells' budgets and its own do not fit the card
        (:func:`books.admission_short`, the bytes short then). ``suspends`` False
        (``ArbiterApp.suspend_wait`` not over yet): where another cell runs on the card
        (:func:`books.running_cells`) and pausing idle kernels would not cover what is
        short, nobody is taken off the card and the kernel waits for that cell to end.
        With ``ArbiterApp.release_first``, idle kernels whose cached free blocks cover what
        is short (:func:`books.releases`) are asked to give them back first
        (:meth:`.moves.Moves.release`), nobody paused; the card is then read again, and
        what is still short is made as without."""
        a = self.arbiter
        reading = await a.read(uuid)
        others = [k for k in a.on_card(uuid) if k is not kernel]
        if admit:
            over = books.admission_short(kernel, reading.free, others, uuid)
            if over > 0:
                if notes is not None:
                    running = sum(1 for k in others if k.state == ACTIVE)
                    notes.append(
                        _NotAdmitted(
                            f"the budgets of the {running} running cell(s) and this one's pass what the GPU "
                            f"could give them at once by {format_bytes(over)}: waiting for a cell to end"
                        )
                    )
                return over, reading
        short = books.shortfall(kernel, reading.free, others, uuid)
        if short <= 0:
            return short, reading
        leaving = [k for k in others if k.moving in ("pause", "suspend")]
        if leaving and short <= sum(books.held(k, uuid) for k in leaving):
            # a room made ahead takes them off the card now, outside its lock: their memory
            # is this kernel's sooner than any other victim's (the room loop is woken then)
            if notes is not None:
                names = ", ".join(k.server.key for k in leaving)
                notes.append(f"{len(leaving)} idle kernel(s) leaving the card: {names}")
            return short, reading
        order = self._order(kernel, others)
        released = a.config.release_first and await self._release(
            kernel, uuid, order, short, Reason.ROOM, tell, notes
        )
        if released:  # the caches alone cover it: nobody stored, nobody to bring back later
            reading = await a.read(uuid)
            others = [k for k in a.on_card(uuid) if k is not kernel]
            short = books.shortfall(kernel, reading.free, others, uuid)
            if short <= 0:
                return short, reading
            order = self._order(kernel, others)  # what they hold now: pauses as without
        running = books.running_cells(others)
        if not suspends and running and any(action == "suspend" for _, action in order):
            pauses = [(victim, action) for victim, action in order if action == "pause"]
            if sum(books.held(victim, uuid) for victim, _ in pauses) < short:
                if notes is not None:
                    notes.append(
                        _ForACell(
                            f"its room would need paused kernels suspended: waiting for one of the "
                            f"{len(running)} running cell(s) to end (up to {a.config.suspend_wait:g} s)"
                        )
                    )
                return short, reading
            order = pauses
        while order:
            if order[0][0].declined(order[0][1], time.monotonic(), REFUSAL_SECONDS):
                victim, action = order.pop(0)
                if notes is not None:  # asking again would get the same answer, or none
                    notes.append(f"{victim.server.key} stays: it declined to {action} a moment ago")
                continue
            _, moved = await self._take_head(kernel, uuid, order, short, Reason.ROOM, tell, notes, host_first)
            if not moved:
                continue
            reading = await a.read(uuid)
            others = [k for k in a.on_card(uuid) if k is not kernel]
            short = books.shortfall(kernel, reading.free, others, uuid)
            if short <= 0:
                break
        return short, reading

    def _order(self, kernel: Kernel, others: list[Kernel]) -> list:
        """The victims for ``kernel``'s room among ``others`` (:func:`books.victims`), less
        the suspends where the driver's checkpoint is not available."""
        a = self.arbiter
        return [
            (victim, action)
            for victim, action in books.victims(others, kernel, a.config.suspend_after)
            if action == "pause" or a.checkpoint is not None
        ]

    async def _take_head(
        self,
        kernel: Kernel,
        uuid: str,
        order: list,
        short: int,
        reason: Reason,
        tell=None,
        notes=None,
        host_first=None,
    ) -> tuple[int, bool]:
        """Take the head of ``order`` (``[(victim, action)]``, consumed) off card ``uuid`` for
        ``kernel``'s room, ``short`` bytes missing: the suspends at its head at once
        (:meth:`_suspends_together`), else its first victim alone, as
        :meth:`.moves.Moves.take_off` does (``tell``, ``notes``, ``host_first`` as there; a
        word each second to ``tell``). Returns what the victims taken held on the card
        (:func:`books.held`, read before they moved; bytes) and whether a lone victim left
        the card (True for suspends made together, each said for itself)."""
        a = self.arbiter
        step = self._head_step(order, short, uuid)
        together = [victim for victim, _ in step] if len(step) > 1 else []
        if together:
            del order[: len(together)]
            freed = sum(books.held(v, uuid) for v in together)
            await self._suspend_all(kernel, together, short, tell, notes, host_first, reason)
            return freed, True
        victim, action = order.pop(0)
        freed = books.held(victim, uuid)
        taking = a.moves.take_off(
            victim, action, reason, for_whom=kernel.server.key, tell=tell, notes=notes, host_first=host_first
        )
        if tell is None:
            return freed, await taking
        # a word each second: a suspend of tens of GiB takes tens of seconds
        verb = "pausing" if action == "pause" else "suspending"
        moved = await said_while(
            taking,
            tell,
            f"making room on GPU {kernel.slice.gpu_index}: {verb} {victim.server.key} "
            f"(idle {victim.idle_for():.0f} s), {format_bytes(short)} still to free",
        )
        return freed, moved

    def _head_step(self, order: list, short: int, uuid: str) -> list:
        """The step at the head of ``order`` (``[(victim, action)]``, not consumed; a room
        ``short`` bytes short on card ``uuid``): its suspends to make together
        (:meth:`_suspends_together`), else its first victim alone; ``[(victim, action)]``."""
        return [(victim, "suspend") for victim in self._suspends_together(order, short, uuid)] or order[:1]

    def _suspends_together(self, order: list, short: int, uuid: str) -> list[Kernel]:
        """The suspends at the head of ``order`` to make at once
        (:func:`books.suspends_together`), none that declined a moment ago: the most of
        them, two or more, whose checkpoints the host has memory for now
        (:meth:`.tiering.Tiering.host_step` for their sum: each one's own look would count
        the same free memory); else ``[]``, and they go one at a time, each making its host
        memory as it does alone.

        All or none sent them one at a time whenever the host tier was near its mark: a
        cell waited for six suspends one after another (0.6 to 1.2 s each) before five went
        at once (48 MLP sessions, seeds 7 and 23 at 09f6060,
        ``benchmarks/results/sessions-h100.json``)."""
        now = time.monotonic()
        fresh = []
        for victim, action in order:
            if action != "suspend" or victim.declined(action, now, REFUSAL_SECONDS) or victim.moving:
                break
            fresh.append((victim, action))
        together = books.suspends_together(fresh, short, uuid)
        for n in range(len(together), 1, -1):
            need = sum(tiers.host_need(k) for k in together[:n])
            step, _, _ = self.arbiter.tiering.host_step(together[0], need)
            if step == "fits":
                return together[:n]
        return []

    async def _suspend_all(
        self, kernel: Kernel, together: list[Kernel], short: int, tell, notes, host_first, reason=Reason.ROOM
    ):
        """Suspend ``together`` for ``kernel``'s room at once, each as
        :meth:`.moves.Moves.take_off` does alone, telling the cell once a second."""
        a = self.arbiter
        taking = asyncio.gather(
            *(
                a.moves.take_off(
                    victim,
                    "suspend",
                    reason,
                    for_whom=kernel.server.key,
                    notes=notes,
                    host_first=host_first,
                )
                for victim in together
            )
        )
        if tell is None:
            await taking
            return
        names = ", ".join(v.server.key for v in together)
        await said_while(
            taking,
            tell,
            f"making room on GPU {kernel.slice.gpu_index}: suspending {len(together)} idle kernels at once "
            f"({names}), {format_bytes(short)} still to free",
        )
