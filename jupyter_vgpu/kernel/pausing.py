"""When and how this kernel pauses, suspends and comes back.

Ties the :class:`~.gate.Gate` (no message's handler runs while memory is away) to the
:class:`~.pause.engine.PauseEngine` (the memory itself), to the driver's checkpoint (the
whole process), and to the pausable allocator's own gate (``native/gate.c``), which holds
every GPU call of every thread of the kernel while it is away. Pauses are asked for by
the node arbiter (to make room for another kernel), by ``%vgpu pause`` (once the cell
ends) and by chaos mode (after every cell).

**Code that runs between cells** (an asyncio task, a tornado callback, a timer, a thread,
a widget's callback) keeps no kernel on the card: a pause first closes the allocator's
gate, waiting for the GPU calls already in the driver to return, and from then on every
launch, copy or set of any thread waits before the driver (every driver call, while
suspended), the GIL let go. The first call held wakes this kernel's wake thread, which
brings the kernel back as a message would (room from the arbiter, then the memory, with
the same words in the last cell's output); the calls then go on. So no thread touches
released memory, and no thread blocks inside the driver's checkpoint lock with the way
back depending on it. ``%vgpu status`` names such code (``between cells``).

A pause is refused while the kernel runs a message, and whenever it could not release all
of the kernel's GPU memory safely (:meth:`PauseControl.blockers`): memory shared with
another process (CUDA IPC), managed memory, memory allocated a way the allocator does
not cover, child processes holding GPU memory. Such a kernel is suspended instead when
the GPU is needed: the driver's checkpoint takes all of it, context included. The driver
cannot checkpoint managed memory, nor bring back a process that shares memory through
CUDA IPC: such a kernel is paused in part (:meth:`PauseControl.pauses_partly`), what is
shared or managed staying on the card. ``%vgpu status`` says which.

The engine is made on the first pause, once the kernel uses CUDA: a kernel that never
touched the GPU has nothing on it, and its pause moves nothing. On a simulated GPU (or
PyTorch without CUDA) a pause is a **stand-in**: the states and the arbiter's books
run for real, no memory moves, and the figures say so; except for segments the kernel's
code made through the pausable allocator's host backend (the tests do), which are
paused for real, bytes and all.

Coming back never waits in silence (:mod:`.progress`): room from the node arbiter (it
says what it does meanwhile), or, with no arbiter to ask (gone, restarting), the
kernel's own look at the card: a paused kernel comes back on its own when the card has
room for it, else waits (saying so) for the arbiter or for room until
``resume_timeout``, then fails the cell with a readable error, its data kept on the host.
A suspended kernel whose checkpoint's holder ended (the arbiter, chaos mode's helper)
restores itself through a helper of its own.

:class:`PauseControl` is one object with one state (its gate's); this module holds what
decides (when to pause, suspend or do neither; chaos mode; the figures), and its parts
live beside it, each in a module of its own: :mod:`.memory_path` (the allocator and the
engine), :mod:`.blockers` (what keeps a pause from releasing all of the memory),
:mod:`.held_calls` (the allocator's gate and the wake thread), :mod:`.suspending` (the
driver's checkpoint), :mod:`.coming_back` (room, then memory) and :mod:`.host_memory`
(pinned ahead, trimmed, spilled).
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading
from collections.abc import Callable

from jupyter_vgpu.host import procs

from . import gate as g
from .blockers import Blockers
from .coming_back import ComingBack
from .held_calls import HeldCalls
from .host_memory import HostMemory
from .memory_path import MemoryPath
from .pause.states import PauseState
from .suspending import Suspending

log = logging.getLogger("jupyter_vgpu")


class PauseControl(MemoryPath, HeldCalls, Blockers, Suspending, ComingBack, HostMemory):
    """Pauses, suspends and resumes one kernel.

    Args:
        config: the kernel's :class:`~.config.VGPUKernel` settings.
        torch_module: returns the torch module, or None while it is not imported.
        simulated: returns True when the slice's GPU is simulated (stand-in pauses).
        kernel: the ipykernel ``Kernel`` (its event loop is checked for idle code), or None.
        say: shows text in the running cell's output: ``say(text, end="\n")``.
        card_free: returns the free bytes now of the slice's card with the least free
            (NVML), or None where that is unknown (a simulated card).
        gpu_processes: returns the processes holding memory on the slice's cards,
            ``{pid: bytes}`` (NVML).
    """

    def __init__(
        self,
        config,
        torch_module: Callable[[], object],
        simulated: Callable[[], bool],
        kernel=None,
        say: Callable[..., None] = lambda text, end="\n": None,
        card_free: Callable[[], int | None] = lambda: None,
        gpu_processes: Callable[[], dict[int, int]] = dict,
    ):
        self.config = config
        self._torch = torch_module
        self._simulated = simulated
        self._gpu_processes = gpu_processes
        self.kernel = kernel
        self.say = say
        self.card_free = card_free
        self.gate = g.Gate(self._come_back, on_change=self._changed, on_wait=self._while_busy)
        self.last_refusal: str | None = None
        self.last_error: str | None = None  # why the last pause after a cell failed
        self.prefetch_refusal: str | None = None  # why the last prefetch did not bring it back
        self.last_notice: str | None = None  # the node arbiter's last word (over budget)
        #: asks the node arbiter for room, blocking: (purpose, progress) -> None, purpose
        #: "run" | "resume" | "restore"; raises MemoryError when it refuses and
        #: ArbiterUnavailable when there is no arbiter. Set by the arbiter client.
        self.ask_room: Callable[..., None] | None = None
        self.listeners: list[Callable[[str], None]] = []
        #: the node's host figures as the arbiter last told them (``host_used``,
        #: ``host_limit``, bytes), or None without an arbiter. Set by the kernel hook.
        self.node_figures: Callable[[], dict | None] = lambda: None
        self._pause_after_cell = False
        # the memory path (:mod:`.memory_path`)
        self.engine = None
        self._engine_lock = threading.Lock()  # one engine, whichever thread asks first
        self._allocator_found: tuple | None = None  # (the allocator or None), once looked up
        self.unavailable: str | None = None  # why memory cannot be paused here
        # what keeps a pause from releasing all of the memory (:mod:`.blockers`)
        self._blockers: tuple[float, list[str]] | None = None  # (monotonic time, reasons)
        self._staying: set[str] = set()  # of those reasons, memory that may stay through a pause
        # the allocator's gate (:mod:`.held_calls`)
        self._waker: threading.Thread | None = None  # brings the kernel back for a held GPU call
        # the way back (:mod:`.coming_back`)
        self._waits = threading.local()
        # the driver's checkpoint (:mod:`.suspending`)
        self._helper: subprocess.Popen | None = None
        self.suspended_with: list[int] = []  # child processes suspended with the kernel
        #: bytes per GPU UUID the kernel and ``suspended_with`` held when the driver took
        #: them off (NVML, just before): what a restore needs free (:mod:`..host.checkpoint`)
        self.suspend_need: dict[str, int] = {}
        self.last_suspend_seconds: float | None = None
        self.last_restore_seconds: float | None = None
        # host memory pinned ahead (:mod:`.host_memory`)
        self._left_idle = threading.Event()  # set whenever the kernel leaves ``idle``
        self._preparing: threading.Thread | None = None
        self._trimmed = False  # the arbiter took the warm slabs back: pin nothing ahead
        #: what the last trim after a pause gave back (:meth:`trim_while_paused`), or None
        self.last_trim: dict | None = None
        self._trimming: threading.Thread | None = None

    # -- state -----------------------------------------------------------------------------

    @property
    def state(self) -> PauseState:
        """``active`` (running a message), ``idle``, ``paused``, ``suspended``, or a
        transition (``pausing``, ``suspending``, ``resuming``)."""
        s = self.gate.state
        return PauseState.ACTIVE if s == g.BUSY else PauseState(s)

    def _changed(self, state: str) -> None:
        if state != g.IDLE:
            self._left_idle.set()
        with self.own_calls():  # reports; and under the gate's lock, where a held call would stall it
            for listener in list(self.listeners):
                try:
                    listener(state)
                except Exception:
                    log.exception("jupyter-vgpu: a state listener failed")

    def own_calls(self):
        """A context in which the calling thread's GPU calls are this package's own (its
        reports, its look at PyTorch's figures): never held at the allocator's gate. They
        are made as before the gate existed: the figures read while the kernel is away
        never need the memory, and every driver call the package makes while the kernel is
        suspended is one the driver's lock does not stop."""
        allocator = self._allocator()
        return allocator.machinery() if allocator is not None else contextlib.nullcontext()

    # -- going away ------------------------------------------------------------------------

    def pause(self) -> dict:
        """Pause the kernel now (it must be idle); returns the engine's figures.

        A kernel that can neither be paused whole nor suspended is paused in part
        (:meth:`pauses_partly`): what is shared or managed stays on the card.

        Raises:
            gate.Refused: the kernel is not idle, or a pause could not release its GPU
                memory safely (:meth:`blockers`; the message says why and what happens
                instead).
            PauseError: the pause failed and was undone.
        """
        if self.gate.state != g.IDLE:
            raise g.Refused(f"the kernel is {self.gate.state}")
        reasons = self.blockers()
        if reasons and not self.pauses_partly(reasons):
            self.last_refusal = f"{'; '.join(reasons)}; {self.consequence(reasons)}"
            raise g.Refused(self.last_refusal)
        outcome = {}
        from .pause import vmm

        def work():
            self._close_gate(vmm.PAUSED)  # from here no thread's GPU call reaches the memory
            try:
                with self._plain():
                    engine = self._engine()
                    if engine is not None:
                        outcome["pause"] = engine.pause()
            except BaseException:
                self._open_gate()
                raise

        self.gate.away(work, to=g.PAUSED)
        self.last_refusal = None
        self._trimmed = False  # the slabs this pause pinned are kept warm again
        self.trim_while_paused()
        return outcome

    def release_cache(self) -> int:
        """Give back the free blocks PyTorch's CUDA allocator keeps cached
        (``torch.cuda.empty_cache``) while the kernel is idle, for another kernel's room
        (the arbiter's ``release``): nothing is stored, every tensor stays on the card,
        and the next cell needs no resume, only allocating its working memory again.
        Returns the bytes given back: ``memory_reserved`` before less after, summed over
        every device the kernel initialized (0 where it has not initialized CUDA: a
        simulated card, or a kernel that never used the GPU).

        It runs under the gate (:meth:`.gate.Gate.while_idle`): no cell starts and no
        pause begins meanwhile, so the frees never meet the allocator's gate closed by a
        pause (which would take them for a call to bring the kernel back for). Code
        between cells (a thread) may allocate meanwhile: ``empty_cache`` takes the
        allocator's lock and frees only blocks no tensor holds, as when a user calls it.

        Raises:
            gate.Refused: the kernel is not idle (it runs a message, or is paused or
                suspended: its memory is not on the card).
        """

        def release() -> int:
            torch = self._torch_cuda()  # read under the gate, as the rest
            if torch is None:
                return 0
            devices = range(torch.cuda.device_count())
            before = sum(torch.cuda.memory_reserved(d) for d in devices)
            torch.cuda.empty_cache()
            return max(0, before - sum(torch.cuda.memory_reserved(d) for d in devices))

        return self.gate.while_idle(release)

    def take_off(self) -> dict:
        """Free the GPU of this idle kernel as the node arbiter would: pause it, or suspend
        it where a pause is not safe (:meth:`blockers`), or pause it in part where it can
        be neither (:meth:`pauses_partly`). Returns the engine's figures of a pause (empty
        after a suspend).

        Raises:
            gate.Refused: the kernel is busy, or can be neither paused nor suspended (the
                message says why).
            PauseError, RuntimeError: the pause or suspend failed and was undone.
        """
        reasons = self.blockers()
        if not reasons or self.pauses_partly(reasons):
            return self.pause()
        why = self.suspend_unavailable()
        if why:
            self.last_refusal = f"{'; '.join(reasons)}; it cannot be suspended either: {why}"
            raise g.Refused(self.last_refusal)
        self.suspend_with_helper()
        return {}

    # -- cells -----------------------------------------------------------------------------

    def pause_after_cell(self) -> None:
        """Take the kernel off the GPU once the running cell has ended (``%vgpu pause``):
        paused, or suspended where a pause is not safe (:meth:`take_off`)."""
        self._pause_after_cell = True

    def after(self, msg_type: str) -> None:
        """Called once a handler is done (in its thread): chaos mode and ``%vgpu pause``."""
        if msg_type != "execute_request" or self.gate.busy:
            return
        self.let_go_shared()  # what the cell's resume read from the node's shared pieces
        asked, self._pause_after_cell = self._pause_after_cell, False
        if not (asked or self.config.chaos):
            self.prepare_ahead()
            return
        try:
            if self.config.chaos == "suspend":
                if self.pauses_partly(self.blockers()):
                    self.pause()  # the driver cannot take it: what can leave, leaves
                else:
                    self.suspend_with_helper()  # paused first when it can be
            elif self.config.chaos == "pause":
                self.pause()
            else:
                self.take_off()
            self.last_error = None
        except g.Refused as e:
            log.info("jupyter-vgpu: no pause after this cell: %s", e)
        except Exception as e:
            self.last_error = f"{type(e).__name__}: {e}"
            log.warning("jupyter-vgpu: the pause after this cell failed: %s", self.last_error)

    # -- figures ---------------------------------------------------------------------------

    def stats(self) -> dict:
        """The kernel's pause figures for reports and ``%vgpu status``: ``state``,
        ``paused_bytes``, ``unpausable_bytes``, ``host_bytes``, ``ratio``, ``codec``,
        ``last_pause_seconds``, ``last_resume_seconds``, ``stand_in``, ``pausable`` (True,
        False, or None where nothing is known: a simulated GPU, no CUDA yet),
        ``not_pausable`` (why not and what happens instead, or None), ``between_cells``
        (code of the user's that may run between cells, in words, or None),
        ``unavailable``, ``refused``, ``private_bytes`` (the process's own resident
        memory now, bytes) and ``last_trim`` (what it gave back once last paused)."""
        out = {
            "state": self.state,
            "paused_bytes": 0,
            "unpausable_bytes": 0,
            "disk_bytes": 0,
            "live_bytes": 0,
            "host_bytes": 0,
            "ratio": None,
            "codec": None,
            "codec_name": None,
            "last_pause_seconds": None,
            "last_resume_seconds": None,
            "pinned_bytes": 0,
        }
        if self.engine is not None:
            with self._plain():  # reports run between cells, under any mode a user left entered
                out.update(self.engine.stats())
            out["state"] = self.state
        # asked afresh only while the kernel is on the GPU: every driver call of a
        # suspended process (NVML's too) waits for its restore
        fresh = self.state in (PauseState.ACTIVE, PauseState.IDLE)
        reasons = self.blockers(max_age=5.0) if fresh else (self._blockers or (0, None))[1]
        pausable = None if reasons is None else not reasons
        not_pausable = f"{'; '.join(reasons)}; {self.consequence(reasons)}" if reasons else None
        between = self.idle_code() if fresh else []
        out.update(
            stand_in=self.stand_in,
            pausable=pausable,
            not_pausable=not_pausable,
            between_cells="; ".join(between)[:4000] or None,
            unavailable=self.unavailable,
            refused=self.last_refusal,
            error=self.last_error,
            last_suspend_seconds=self.last_suspend_seconds,
            last_restore_seconds=self.last_restore_seconds,
            private_bytes=procs.private_bytes("self"),
            last_trim=self.last_trim,
        )
        return out
