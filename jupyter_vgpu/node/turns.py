"""Cells take turns on a card: a cell waits, for a bounded time, for the cells running on
its card to end before it starts beside them (``ArbiterApp.turn_wait``).

Cells that meet on a card share its compute: two 1 s cells sent together each take about
2 s (and more under time-slicing, whose switches between contexts cost the card 8%,
``benchmarks/results/time-slicing-h200.json``). Run one after the other, the first takes
1 s and the second 2 s: the same total, but half the cells end twice as soon. For cells
of about one length, taking turns is the order with the least tail
(:mod:`jupyter_vgpu.testing.compute_share`, ``"one at a time"``). Which cells are short
is not known ahead, so the wait is bounded, and a cell's age is taken as the sign of
its length: a cell waits only for cells that began to run less than ``turn_wait``
seconds ago, and for at most ``turn_wait`` itself. A cell that has run ``turn_wait``
seconds is long (a training loop): cells sent after that start beside it at once, and
one sent before waits only out its first ``turn_wait`` seconds. So an hour of training
costs the others' cells nothing past its first seconds, where a wait for every running
cell would cost each of them ``turn_wait``.

Only cells the user ran take turns (the kernel's request for room says ``cell``,
protocol version 6: an ``execute_request`` that is not silent); completion, inspection,
widgets and code between cells never wait in line. A cell waits for young running cells
of its priority or above, and for the cells ahead of it in line on any of its cards (sent
before it, of its priority or above); it keeps its place until its room is granted or
refused, so that the cells behind it keep waiting while its room is made. The line is
the arbiter's books, and a cell's age counts from the arbiter's grant; a kernel's word
is only whether a request is for a cell, and that word is checked: a kernel that runs
code for longer than ``turn_wait`` on a request it did not call a cell (one that hides
its cells, a kernel of a protocol before version 6, or a long silent execute or widget
callback) takes turns with every request from then on (:meth:`Turns.left_active`, a
``turns kept`` decision). So a kernel gains at most one cell's wait by not saying; the
others wait for its young cells at most ``turn_wait``, as for any cell. Turns are a
courtesy, not a limit: nobody's budget or share depends on them, and no kernel can hold
another's cell up longer than ``turn_wait``.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, NamedTuple

from . import books

if TYPE_CHECKING:
    from .arbiter import Arbiter
    from .books import Kernel


class _Place:
    """A cell's place in the lines of its cards: its kernel and when it was sent
    (monotonic seconds)."""

    __slots__ = ("kernel", "since")

    def __init__(self, kernel: Kernel, since: float):
        self.kernel, self.since = kernel, since


class Ahead(NamedTuple):
    """What a cell in line waits for (:meth:`Turns.ahead`): ``running``, the young cells
    running on its cards (it waits for them); ``long``, those that have run
    ``turn_wait`` seconds (it does not); ``waiting``, the cells ahead of it in line;
    ``long_at``, when the last young one turns long (monotonic seconds; ``math.inf``:
    none runs)."""

    running: int
    long: int
    waiting: int
    long_at: float


class Turns:
    """The lines of cells waiting their turn, one per card.

    Args:
        arbiter: the :class:`~.arbiter.Arbiter` (its kernels, ``decide``, ``notify``,
            ``wait_for_change`` and ``ArbiterApp.turn_wait``).
    """

    def __init__(self, arbiter: Arbiter):
        self.arbiter = arbiter
        self.lines: dict[str, list[_Place]] = collections.defaultdict(list)

    def ahead(self, place: _Place, now: float) -> Ahead:
        """What ``place``'s cell waits for at monotonic ``now`` (:class:`Ahead`): the cells
        of its priority or above that run on its cards with their room granted
        (:func:`books.running_cells`), young (begun less than ``turn_wait`` seconds
        before: ``Kernel.since``) or long, and those ahead of it in line there."""
        kernel = place.kernel
        wait = self.arbiter.config.turn_wait
        cards = kernel.slice.gpu_uuids
        others = {id(k): k for card in cards for k in self.arbiter.on_card(card) if k is not kernel}
        running = [k for k in books.running_cells(list(others.values())) if k.priority >= kernel.priority]
        young = [k.since + wait for k in running if k.since + wait > now]
        waiting = {
            id(p)
            for card in cards
            for p in self.lines[card]
            if p.since < place.since and p.kernel is not kernel and p.kernel.priority >= kernel.priority
        }
        return Ahead(len(young), len(running) - len(young), len(waiting), max(young, default=math.inf))

    def takes_turns(self, kernel: Kernel, cell: bool) -> bool:
        """Whether a request for room of ``kernel`` (to run code, not to grow or
        prefetch) waits its turn: turns are on and it says ``cell``, or its kernel's
        word was found wanting (:attr:`Kernel.turns_kept`)."""
        return self.arbiter.config.turn_wait > 0 and (cell or kernel.turns_kept)

    def granted(self, kernel: Kernel, cell: bool) -> None:
        """``kernel``'s request for room to run code (``cell``: whether it said so) was
        answered: where it was granted and did not say ``cell``, when is kept
        (:attr:`Kernel.unsaid_since`) for :meth:`left_active` to check the word."""
        running = kernel.state == books.ACTIVE and kernel.granted > 0
        kernel.unsaid_since = time.monotonic() if running and not cell else None

    def left_active(self, kernel: Kernel) -> None:
        """``kernel`` reported itself no longer active: where it ran code for longer
        than ``turn_wait`` from a grant that did not say ``cell``, its requests take
        turns from now on (a ``turns kept`` decision). Its code is then a cell by what
        it did, however it was sent: one that hides its cells gains at most one wait."""
        since, kernel.unsaid_since = kernel.unsaid_since, None
        wait = self.arbiter.config.turn_wait
        if since is None or kernel.turns_kept or not wait:
            return
        ran = time.monotonic() - since
        if ran > wait:
            kernel.turns_kept = True
            self.arbiter.decide(
                "turns kept",
                server=kernel.server.key,
                pid=kernel.pid,
                seconds=round(ran, 3),
                message=f"it ran code for {ran:.1f} s on a request for room that did not say it was "
                f"a cell: its requests take turns from now on",
            )

    @contextlib.asynccontextmanager
    async def turn(self, kernel: Kernel, tell: Callable[[str], Awaitable[None]]) -> AsyncIterator[bool]:
        """Wait for ``kernel``'s cell's turn on its cards: until no young cell of its
        priority or above runs there (:meth:`ahead`) and none is ahead of it in line, or
        ``ArbiterApp.turn_wait`` seconds (or the kernel left, or its cell was given up:
        the kernel reported itself active, then not). ``await tell(message)`` hears what
        it waits for, once a second. Yields whether the cell still wants its room (False:
        given up, or the kernel left); its place is kept until the block ends. A wait is a
        decision (``turn``: how long, and whether its turn came, the cells running turned
        long, its wait ran out, or the cell was given up)."""
        a = self.arbiter
        wait = a.config.turn_wait
        place = _Place(kernel, time.monotonic())
        until = place.since + wait
        cards = kernel.slice.gpu_uuids
        for card in cards:
            self.lines[card].append(place)
        try:
            waited_for = None
            wanted, came = True, "its turn came"
            seen_running = False  # its report of the cell (``active``) may come after the request
            while True:
                seen_running = seen_running or kernel.state == books.ACTIVE
                if kernel not in a.kernels or (seen_running and kernel.state != books.ACTIVE):
                    # gone, or its cell interrupted: its place holds nobody up
                    wanted, came = False, "the cell was given up"
                    break
                now = time.monotonic()
                running, long, waiting, long_at = self.ahead(place, now)
                if not (running or waiting):
                    if long:
                        came = f"the {long} cell(s) running had run {wait:g} s: it runs beside them"
                    break
                left = until - now
                if left <= 0:
                    came = f"its {wait:g} s wait ran out"
                    break
                waited_for = waited_for or (running, waiting)
                await tell(
                    f"waiting for its turn on GPU {kernel.slice.gpu_index}: {running} cell(s) running, "
                    f"{waiting} ahead in line (up to {wait:g} s, then it runs beside them)"
                )
                await a.wait_for_change(min(1.0, left, long_at - now))
            waited = time.monotonic() - place.since
            if waited_for is not None:
                a.decide(
                    "turn",
                    server=kernel.server.key,
                    pid=kernel.pid,
                    gpu=kernel.slice.gpu_uuid,
                    seconds=round(waited, 3),
                    message=f"behind {waited_for[0]} running cell(s) and {waited_for[1]} in line: {came}",
                )
            yield wanted
        finally:
            for card in cards:
                self.lines[card].remove(place)
            await a.notify()  # the cells behind it look again
