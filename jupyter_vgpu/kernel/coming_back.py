"""Coming back: room on the card, then the memory, before any code of the kernel runs.

:class:`ComingBack` is a part of :class:`~.pausing.PauseControl` (its state: ``_waits``,
the wait a message shows while a pause or resume is in progress). The gate calls
:meth:`ComingBack._come_back` in the thread of the first message that needs the kernel
(or the wake thread, for a GPU call made between cells; or a prefetch ahead of a cell):
room from the node arbiter (which restores a suspended kernel), or, with no arbiter to
ask, the kernel's own look at the card (NVML); then the paused memory back
(:meth:`~.pause.engine.PauseEngine.resume`), retried until ``resume_timeout`` while the
card is full. Every wait longer than a second is shown in the cell's output
(:mod:`.progress`); a way back that fails says why, the data kept on the host.
"""

from __future__ import annotations

import logging
import time

from jupyter_vgpu.units import format_bytes

from . import gate as g
from .arbiter_client import ArbiterUnavailable
from .pause.states import PauseState
from .progress import Progress

log = logging.getLogger("jupyter_vgpu")


class ComingBack:
    """The way back of a :class:`~.pausing.PauseControl`'s kernel: room, then memory."""

    def prefetch(self) -> bool:
        """Bring this paused or suspended kernel back ahead of a cell its user is about to
        run (they opened, focused or edited its notebook: the server passes the word on
        through ``server.json``), if the card has room now: the node arbiter grants it
        taking off the card only kernels idle past their ``idle_seconds``, at most once per
        ``prefetch_interval`` per user, and then makes the room its cell will need;
        without an arbiter, a paused kernel comes back where NVML shows room. Nothing is
        printed (no cell runs); a cell arriving meanwhile waits for it. True when the
        kernel came back; False when it was not away, or the prefetch was refused or
        failed (the kernel stays as it was, and its next cell brings it back as usual;
        ``prefetch_refusal`` says why, None where it was not away)."""
        self.prefetch_refusal = None
        try:
            return self.gate.back(lambda prior: self._come_back(prior, prefetch=True))
        except Exception as e:
            self.prefetch_refusal = str(e)
            log.info("jupyter-vgpu: no prefetch: %s", e)
            return False

    def _come_back(self, state: str, prefetch: bool = False, woken: bool = False, cell: bool = False) -> None:
        """Called by the gate, in the thread of the first message that needs the kernel
        (or, ``woken``, of the kernel's own wake thread: a GPU call made between cells):
        room (from the arbiter, which restores a suspended kernel; without one, the
        kernel's own look at the card), then the memory back, then the GPU calls held
        meanwhile go on. Every wait longer than a second is shown in the cell's output
        (the last cell's, when woken), and kept up to date. A ``prefetch`` asks once,
        waits for nothing and prints nothing; one that fails leaves the held calls
        waiting for the next message; any other way back that fails makes them return an
        error that says why. ``cell``: the message is a cell the user ran (the arbiter
        gives it its turn on the card)."""
        from .pause import vmm

        purpose = "prefetch" if prefetch else {g.SUSPENDED: "restore", g.PAUSED: "resume"}.get(state, "run")
        what = {
            "run": "asking the node arbiter for room on the GPU",
            "resume": "this kernel is paused: asking the node arbiter for room on the GPU to bring it back",
            "restore": "this kernel is suspended: asking the node arbiter to restore it",
            "prefetch": "bringing this kernel back ahead of its next cell",
        }[purpose]
        if woken:
            what = f"code running between cells used the GPU; {what}"
        progress = Progress((lambda *a, **k: None) if prefetch else self.say, what)
        deadline = time.monotonic() + self.config.resume_timeout
        try:
            alone = self._room(purpose, progress, deadline, suspended=state == g.SUSPENDED, cell=cell)
            if state == g.SUSPENDED:
                self._restore(progress, deadline, alone)
                self._set_gate(vmm.PAUSED)  # the process runs again: only the paused memory waits
            engine = self.engine
            if engine is not None and engine.state == PauseState.PAUSED:
                with self._plain():
                    self._resume_engine(engine, progress, deadline, wait=not prefetch)
        except BaseException as e:
            if not prefetch:
                self._fail_gate(str(e) or type(e).__name__)
            progress.done(f"not brought back: {e}" if isinstance(e, Exception) else None)
            raise
        self._open_gate()
        if purpose != "run":
            progress.done("back on the GPU")
        else:  # a line up after a wait the arbiter never answered says so, not "granted"
            progress.done(progress.what if alone else "room granted")

    def _room(
        self, purpose: str, progress: Progress, deadline: float, suspended: bool = False, cell: bool = False
    ) -> bool:
        """Room for the kernel: from the arbiter (False), or, with none to ask, decided here
        (True): a resident kernel runs, a paused or suspended one comes back once the card
        has room for it. ``cell``: for a cell the user ran (the arbiter's request says so).

        Raises:
            MemoryError: the arbiter refused, or with no arbiter the card had no room
                before ``deadline``; the data stays on the host.
        """
        while True:
            if self.ask_room is None:
                return True
            try:
                self.ask_room(purpose, progress, cell=cell)
                return False
            except ArbiterUnavailable as e:
                if purpose == "run":  # its memory is on the card already: it runs without the arbiter
                    progress.update(f"{e}: running without it")
                    return True
                if purpose == "prefetch":
                    if suspended:  # its own look at the card would wait for its restore
                        raise MemoryError(f"{e}: a suspended kernel comes back when its cell runs") from None
                    need, free = self._room_alone()
                    if free is not None and free < need:
                        raise MemoryError(f"{e}, and the GPU has no room for it now") from None
                    return True  # room seen, or nothing to see (as a resume would)
                if purpose == "restore":
                    # its own look at the card would wait for its restore (every driver call
                    # of a checkpointed process does, NVML's too): the restore itself finds
                    # out whether there is room, and is retried until the deadline
                    return True
                need, free = self._room_alone()
                if free is None or free >= need:
                    if need:
                        progress.update(f"{e}: coming back on its own ({format_bytes(free)} free on the GPU)")
                    return True
                if time.monotonic() >= deadline:
                    raise MemoryError(
                        f"{e}, and the GPU has {format_bytes(free)} free where this kernel needs "
                        f"{format_bytes(need)} to come back; waited {self.config.resume_timeout:.0f} s. "
                        "Its data is kept in host memory: run the cell again to try again."
                    ) from None
                progress.update(
                    f"{e}; waiting for it, or for {format_bytes(need)} free on the GPU to come back "
                    f"on its own ({format_bytes(free)} free now)"
                )
                progress.sleep(1.0)

    def _room_alone(self) -> tuple[int, int | None]:
        """``(bytes the kernel needs on the card to come back, bytes free there or None
        when unknown)``, as the kernel sees it without the arbiter (NVML)."""
        engine = self.engine
        if engine is None or engine.state != PauseState.PAUSED or engine.device is None:
            return 0, None
        need = engine.room_needed()
        try:
            free = self.card_free()
        except Exception:
            free = None
        return need, free

    def _resume_engine(self, engine, progress: Progress, deadline: float, wait: bool = True) -> None:
        """The paused memory back on the card; where the card turns out full, ask the
        arbiter again and retry until ``deadline`` (``wait`` False: give up at once).

        Raises:
            MemoryError: no room; the data stays in host memory (or on disk).
        """
        from .pause import vmm

        while True:
            where = "disk" if engine.disk_bytes() else "host memory"
            progress.update(f"bringing {format_bytes(engine.paused_bytes)} back to the GPU from {where}")
            try:
                progress.run(engine.resume)
                return
            except vmm.DeviceFull:
                need = engine.room_needed()
                if not wait:
                    raise MemoryError(f"the GPU has no room for {format_bytes(need)} now") from None
                if self.ask_room is not None:
                    try:
                        self.ask_room("resume", progress)  # room the arbiter saw was taken meanwhile
                        continue
                    except ArbiterUnavailable:
                        pass
                if time.monotonic() > deadline:
                    raise MemoryError(
                        f"the GPU has no room to bring this kernel back ({format_bytes(need)} needed) "
                        f"after {self.config.resume_timeout:.0f} s; its data is kept in host memory"
                    ) from None
                progress.update(f"waiting for {format_bytes(need)} free on the GPU to bring this kernel back")
                progress.sleep(1.0)

    def _while_busy(self, state: str | None, since: float) -> None:
        """The gate's report on a message waiting for a pause, suspend or resume of this
        kernel in progress (``state`` None: the wait is over): shown like any other wait."""
        progress = getattr(self._waits, "progress", None)
        if state is None:
            if progress is not None:
                progress.done("the kernel is ready")
                self._waits.progress = None
            return
        what = {
            g.PAUSING: "this kernel is being paused (its memory leaves the GPU); it comes back right after",
            g.SUSPENDING: "this kernel is being suspended; it comes back right after",
            g.RESUMING: "this kernel's memory is coming back to the GPU",
        }.get(state, f"this kernel is {state}")
        if progress is None:
            progress = self._waits.progress = Progress(self.say, what)
            progress.t0 = since
        progress.update(what)
        progress.tick()
