"""The allocator's gate: every GPU call of the kernel's threads held while the kernel is
away, and the wake thread that brings it back for the first of them.

:class:`HeldCalls` is a part of :class:`~.pausing.PauseControl` (its state: ``_waker``,
the wake thread). A pause or suspend closes the pausable allocator's gate
(``native/gate.c``) once the calls already in the driver have returned; from then on
every launch, copy or set of any thread (every driver call, while suspended) waits
before the driver, and the first one held writes to an eventfd that the wake thread
reads: it brings the kernel back as a message would (:meth:`~.coming_back.ComingBack._come_back`),
and the held calls go on, or return an error that says why the way back failed.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from . import gate as g

log = logging.getLogger("jupyter_vgpu")


class HeldCalls:
    """The allocator's gate and the wake thread of a :class:`~.pausing.PauseControl`."""

    def _close_gate(self, mode: int) -> None:
        """Hold every GPU call of the kernel's threads from now on (``mode``: the
        allocator's ``PAUSED``, or ``SUSPENDED``: every driver call), once the calls
        already in the driver have returned; the first call held brings the kernel back
        (:meth:`_wake`). Nothing where the allocator is not preloaded.

        Raises:
            gate.Refused: a call of another thread did not return in time.
        """
        allocator = self._allocator()
        if allocator is None:
            return
        from .pause import vmm

        if self._waker is None:
            fd = allocator.wanted_fd()
            self._waker = run_in_thread(lambda: self._wake_loop(fd), "wake")
        try:
            allocator.gate_close(mode, self.config.gate_timeout)
        except vmm.GateBusy as e:
            raise g.Refused(f"{e}: not taken off the GPU") from None

    def _set_gate(self, mode: int) -> None:
        allocator = self._allocator()
        if allocator is not None:
            allocator.gate_set(mode)

    def _open_gate(self) -> None:
        """Let every held call go on: the kernel is back."""
        allocator = self._allocator()
        if allocator is not None:
            allocator.gate_open()

    def _fail_gate(self, why: str) -> None:
        """The way back failed: held calls (and those made before it opens) return an
        error that says why, instead of waiting for good."""
        allocator = self._allocator()
        if allocator is not None:
            allocator.gate_fail(f"this kernel could not come back to the GPU: {why}"[:250])

    def _wake_loop(self, fd: int) -> None:
        while True:
            try:
                os.read(fd, 8)  # a GPU call was held: the kernel is wanted back
            except OSError:
                return
            try:
                self._wake()
            except Exception:
                log.exception("jupyter-vgpu: bringing the kernel back for a held GPU call failed")

    def _wake(self) -> None:
        """Code that runs between cells (an asyncio task, a tornado callback, a timer, a
        thread) made a GPU call while the kernel was away: bring the kernel back now, as
        a message would, with the same words in the last cell's output. Nothing to do
        when it is back already, or a message is bringing it back."""
        while True:
            state = self.gate.state
            if state in (g.PAUSING, g.SUSPENDING, g.RESUMING):
                self.gate.wait_for((g.PAUSED, g.SUSPENDED, g.IDLE, g.BUSY), 1.0)
                continue
            if state not in g.AWAY:
                return
            try:
                if self.gate.back(lambda prior: self._come_back(prior, woken=True)):
                    log.info("jupyter-vgpu: back on the GPU for a call made between cells")
                    return
            except Exception as e:  # _come_back failed the held calls with the reason
                log.warning("jupyter-vgpu: a call made between cells could not bring the kernel back: %s", e)
                return


def run_in_thread(fn: Callable[[], None], name: str) -> threading.Thread:
    """Start ``fn`` in a daemon thread named for this package (not user code)."""
    t = threading.Thread(target=fn, name=f"jupyter-vgpu-{name}", daemon=True)
    t.start()
    return t
