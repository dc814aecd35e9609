"""The kernel's activity gate: no code of the kernel runs while its memory is away.

Every message that can run code (cells, comm and widget messages, completion and
inspection, the debugger) passes :meth:`Gate.enter` before its handler and
:meth:`Gate.leave` after it (:mod:`.dispatch` wraps ipykernel's handlers). The gate
moves between these states, one at a time, under one condition variable:

- ``idle``: nothing runs; the kernel may be paused.
- ``busy``: one or more handlers run (ipykernel 7 runs subshells concurrently).
- ``pausing`` / ``paused``: the memory is leaving / has left the device.
- ``suspending`` / ``suspended``: the whole process is checkpointed by the driver.
- ``resuming``: the memory is coming back; every entry waits for it.

The first handler to enter (while none runs) is admitted, in its own thread, before
any of its code runs: :meth:`enter` calls the ``resume`` function it was given with the
state the kernel is in (``idle``, ``paused`` or ``suspended``); it asks the node arbiter
for room (when there is one) and brings the memory back if it was away, and may block
until the card has room. Handlers entering while one runs are already admitted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from .pause.states import PauseState

T = TypeVar("T")

#: The gate's states: the kernel's (:class:`~.pause.states.PauseState`), but ``busy``
#: where the kernel reports itself ``active`` (handlers run).
IDLE, BUSY = PauseState.IDLE, "busy"
PAUSING, PAUSED = PauseState.PAUSING, PauseState.PAUSED
SUSPENDING, SUSPENDED = PauseState.SUSPENDING, PauseState.SUSPENDED
RESUMING = PauseState.RESUMING
AWAY = (PAUSED, SUSPENDED)


class Refused(RuntimeError):
    """A pause or suspend was refused; the message says why (the kernel is busy, already
    away, or runs code of its own while idle)."""


class Gate:
    """Orders the kernel's handlers and its pauses.

    Args:
        resume: called (in the entering thread, outside the gate's lock) with the state
            the kernel is in (``idle``, ``paused`` or ``suspended``) and ``cell=`` (whether
            the handler runs a cell the user ran, :meth:`enter`) before the first handler
            runs; may block until the card has room; raises to refuse the entry (the
            kernel stays as it was).
        on_change: called with the new state after every change (for reports); must be
            quick and must not call the gate.
        on_wait: called about every 0.25 s, outside the gate's lock, while a handler waits
            for a pause, suspend or resume in progress: ``on_wait(state, since)``
            (``since``: monotonic seconds the wait began), then ``on_wait(None, since)``
            once it is over; it shows the wait in the cell (no silent wait).
    """

    def __init__(
        self,
        resume: Callable[[str], None],
        on_change: Callable[[str], None] | None = None,
        on_wait: Callable[[str | None, float], None] | None = None,
    ):
        self._resume = resume
        self._on_change = on_change or (lambda state: None)
        self._on_wait = on_wait
        self._cond = threading.Condition()
        self.state = IDLE
        self.busy = 0
        #: monotonic seconds of the last handler's end (or of the gate's creation).
        self.last_active = time.monotonic()

    def _set(self, state: str) -> None:
        self.state = state
        self._cond.notify_all()
        self._on_change(state)

    def tell(self) -> None:
        """Call ``on_change`` with the state now, under the gate's lock as a change does:
        for a figure that changed without the state (host memory pinned ahead), so that
        listeners never hear a state older than one they already heard."""
        with self._cond:
            self._on_change(self.state)

    @property
    def idle_seconds(self) -> float:
        """Seconds since the kernel last ran a handler (0 while one runs)."""
        with self._cond:
            return 0.0 if self.busy else time.monotonic() - self.last_active

    def enter(self, cell: bool = False) -> None:
        """Before a handler: wait out a pause in progress, admit the kernel (room, and
        its memory back if it was away) unless a handler already runs, then count the
        handler as running. ``cell``: the handler runs a cell the user ran (its room
        takes its turn on the card).

        Raises:
            Exception: whatever ``resume`` raised; the kernel stays as it was and the
                handler must not run.
        """
        since = None
        while True:
            with self._cond:
                if self.state not in (PAUSING, SUSPENDING, RESUMING):
                    if self.busy:
                        self.busy += 1
                        prior = None
                    else:
                        prior = self.state
                        self._set(RESUMING)
                    break
                since = since or time.monotonic()
                self._cond.wait(0.25)
                state = self.state
            if self._on_wait is not None and state in (PAUSING, SUSPENDING, RESUMING):
                self._on_wait(state, since)
        if since is not None and self._on_wait is not None:
            self._on_wait(None, since)
        if prior is None:
            return
        try:
            self._resume(prior, cell=cell)
        except BaseException:
            with self._cond:
                self._set(prior)
            raise
        with self._cond:
            self.busy += 1
            self._set(BUSY)

    def leave(self) -> None:
        """After a handler."""
        with self._cond:
            self.busy = max(0, self.busy - 1)
            self.last_active = time.monotonic()
            if self.busy == 0:
                self._set(IDLE)

    def away(self, work: Callable[[], None], *, to: str = PAUSED) -> None:
        """Run ``work`` (a pause, or a suspend) while the kernel is idle, holding off every
        handler until it is done; the kernel is then ``to`` (paused or suspended).

        Raises:
            Refused: the kernel is not idle.
            Exception: whatever ``work`` raised; the kernel is left as it was.
        """
        before = None
        with self._cond:
            if self.state == PAUSED and to == SUSPENDED:
                before = PAUSED
            elif self.state != IDLE:
                raise Refused(f"the kernel is {self.state}")
            self._set(PAUSING if to == PAUSED else SUSPENDING)
        try:
            work()
        except BaseException:
            with self._cond:
                self._set(before or IDLE)
            raise
        with self._cond:
            self._set(to)

    def while_idle(self, work: Callable[[], T]) -> T:
        """Run ``work`` while the kernel is idle and stays so: no handler starts and no
        pause or suspend begins until it returns (they wait on the gate's lock, so
        ``work`` must be short: a release of the allocator's cached blocks, milliseconds).
        Returns what ``work`` returns.

        Raises:
            Refused: the kernel is not idle.
            Exception: whatever ``work`` raised.
        """
        with self._cond:
            if self.state != IDLE:
                raise Refused(f"the kernel is {self.state}")
            return work()

    def back(self, work: Callable[[str], None]) -> bool:
        """Bring a paused or suspended kernel back while no handler runs (a prefetch ahead
        of a cell): ``work(prior)`` runs with the gate ``resuming``, so that a message
        arriving meanwhile waits for it; the kernel is then idle, its idle clock restarted
        (its user is working in it). False, and nothing done, when the kernel is not away.

        Raises:
            Exception: whatever ``work`` raised; the kernel is left as it was.
        """
        with self._cond:
            if self.state not in (PAUSED, SUSPENDED) or self.busy:
                return False
            prior = self.state
            self._set(RESUMING)
        try:
            work(prior)
        except BaseException:
            with self._cond:
                self._set(prior)
            raise
        with self._cond:
            self.last_active = time.monotonic()
            self._set(IDLE)
        return True

    def wait_for(self, states: tuple[str, ...], timeout: float | None = None) -> bool:
        """Wait until the gate is in one of ``states``; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.state in states, timeout)
