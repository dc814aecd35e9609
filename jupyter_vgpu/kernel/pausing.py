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
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from jupyter_vgpu.host import checkpoint
from jupyter_vgpu.host.meminfo import meminfo
from jupyter_vgpu.units import format_bytes

from . import gate as g
from .arbiter_client import ArbiterUnavailable
from .idle_code import idle_code
from .pause.states import PauseState
from .progress import Progress

log = logging.getLogger("jupyter_vgpu")


class PauseControl:
    """Pauses, suspends and resumes one kernel.

    Args:
        config: the kernel's :class:`~.config.VGPUKernel` settings.
        torch_module: returns the torch module, or None while it is not imported.
        simulated: returns True when the slice's GPU is simulated (stand-in pauses).
        kernel: the ipykernel ``Kernel`` (its event loop is checked for idle code), or None.
        say: shows text in the running cell's output: ``say(text, end="\n")``.
        card_free: returns the free bytes of the slice's card now (NVML), or None where
            that is unknown (a simulated card).
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
        self._blockers: tuple[float, list[str]] | None = None  # (monotonic time, reasons)
        self._staying: set[str] = set()  # of those reasons, memory that may stay through a pause
        self.kernel = kernel
        self.say = say
        self.card_free = card_free
        self.gate = g.Gate(self._come_back, on_change=self._changed, on_wait=self._while_busy)
        self._waits = threading.local()
        self.engine = None
        self._engine_lock = threading.Lock()  # one engine, whichever thread asks first
        self._left_idle = threading.Event()  # set whenever the kernel leaves ``idle``
        self._preparing: threading.Thread | None = None
        self._trimmed = False  # the arbiter took the warm slabs back: pin nothing ahead
        self.unavailable: str | None = None  # why memory cannot be paused here
        self.last_refusal: str | None = None
        self.last_error: str | None = None  # why the last pause after a cell failed
        self.last_notice: str | None = None  # the node arbiter's last word (over budget)
        #: asks the node arbiter for room, blocking: (purpose, progress) -> None, purpose
        #: "run" | "resume" | "restore"; raises MemoryError when it refuses and
        #: ArbiterUnavailable when there is no arbiter. Set by the arbiter client.
        self.ask_room: Callable[..., None] | None = None
        self.listeners: list[Callable[[str], None]] = []
        #: the node's host figures as the arbiter last told them (``host_used``,
        #: ``host_limit``, bytes), or None without an arbiter. Set by the kernel hook.
        self.node_figures: Callable[[], dict | None] = lambda: None
        self._helper: subprocess.Popen | None = None
        self._waker: threading.Thread | None = None  # brings the kernel back for a held GPU call
        self._allocator_found: tuple | None = None  # (the allocator or None), once looked up
        self.suspended_with: list[int] = []  # child processes suspended with the kernel
        #: bytes per GPU UUID the kernel and ``suspended_with`` held when the driver took
        #: them off (NVML, just before): what a restore needs free (:mod:`..node.checkpoint`)
        self.suspend_need: dict[str, int] = {}
        self._pause_after_cell = False
        self.last_suspend_seconds: float | None = None
        self.last_restore_seconds: float | None = None

    # -- state ---------------------------------------------------------------------------

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

    # -- the engine ----------------------------------------------------------------------

    def _allocator(self):
        """The pausable allocator, when this process was started with it (LD_PRELOAD), else
        None (never built or loaded otherwise). Looked up once."""
        if self._allocator_found is None:
            self._allocator_found = (self._find_allocator(),)
        return self._allocator_found[0]

    @staticmethod
    def _find_allocator():
        preload = os.environ.get("LD_PRELOAD", "")
        if not any(Path(p).name.startswith(("libjupyter_vgpu_vmm", "vmm-")) for p in preload.split(":") if p):
            return None
        from .pause import vmm

        try:
            allocator = vmm.load()
        except vmm.VMMUnavailable:
            return None
        return allocator if allocator.preloaded else None

    def _on_gpu(self) -> bool:
        """True once the kernel has a CUDA context: PyTorch initialized CUDA, or any library
        (CuPy, JAX) made the allocator's driver calls, or NVML lists the process."""
        torch = self._torch()
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return True
        allocator = self._allocator()
        if allocator is not None and allocator.backend == 1:  # vmm.CUDA: a driver call was made
            return True
        try:
            return os.getpid() in self._gpu_processes()
        except Exception:
            return False

    def _cuda_seen(self) -> bool:
        """True once the kernel has a CUDA context, known without asking the driver (safe
        while suspended): PyTorch initialized CUDA, or a library made the allocator's
        driver calls."""
        torch = self._torch()
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return True
        allocator = self._allocator()
        return allocator is not None and allocator.backend == 1  # vmm.CUDA

    def _engine(self):
        """The engine, made on first use; None while the GPU holds nothing of this kernel.

        The engine moves bytes with PyTorch's copy kernels and streams: a kernel whose
        memory another library made (CuPy, JAX) and that never imported PyTorch gets it
        imported here, at its first pause, on the same CUDA context (the device's primary
        context, which all of them use)."""
        if self.engine is not None:
            return self.engine
        with self._engine_lock:  # a pause and the thread pinning ahead may both ask
            if self.engine is None:
                self._make_engine()
            return self.engine

    def _make_engine(self) -> None:
        if self.stand_in or not self._on_gpu():
            self._host_engine()  # no CUDA context, no memory: nothing on a GPU to pause
            return
        from .pause import vmm
        from .pause.engine import PauseEngine

        try:
            allocator = vmm.load()
        except vmm.VMMUnavailable as e:
            self.unavailable = str(e)
            return
        if not allocator.preloaded:
            self.unavailable = (
                "this kernel was not started with the pausable allocator "
                "(start it from a jupyter-vgpu server, which sets LD_PRELOAD)"
            )
            return
        torch = self._torch()
        if torch is None:
            import torch  # only for a kernel holding GPU memory without it
        if not torch.cuda.is_initialized():
            torch.cuda.init()
        units = [s for s in allocator.segments() if s.mapped]
        device = units[0].device if units else torch.cuda.current_device()
        cfg = self.config
        self.engine = PauseEngine(
            torch,
            allocator,
            device,
            use_nvcomp=cfg.use_nvcomp,
            scratch_bytes=cfg.scratch_bytes,
            host_cap_bytes=cfg.host_cap_bytes,
            spill_dir=cfg.spill_dir or None,
        )

    def _host_engine(self):
        """Without CUDA: an engine over the pausable allocator's host backend, when the
        kernel's code made segments through it (the tests: real bytes paused on a
        machine without a GPU); None otherwise (the stand-in moves nothing)."""
        vmm = sys.modules.get("jupyter_vgpu.kernel.pause.vmm")
        allocator = getattr(vmm, "_instance", None)
        if allocator is None or allocator.backend != vmm.HOST or not allocator.segments():
            return None
        from .pause.engine import PauseEngine

        cfg = self.config
        self.engine = PauseEngine(
            self._torch() or _torch_module(), allocator, None,
            host_cap_bytes=cfg.host_cap_bytes, spill_dir=cfg.spill_dir or None,
        )  # fmt: skip
        return self.engine

    def _plain(self):
        """No user TorchFunctionMode or dispatch mode sees what pausing does."""
        torch = self._torch()
        if torch is None:
            return contextlib.nullcontext()
        from .pause.engine import plain_torch

        return plain_torch(torch)

    @property
    def stand_in(self) -> bool:
        """True on a simulated GPU, or with a PyTorch built without CUDA: pauses move no
        memory."""
        torch = self._torch()
        return bool(self._simulated() or (torch is not None and not torch.cuda.is_available()))

    # -- going away ----------------------------------------------------------------------

    def check(self) -> str | None:
        """Why this kernel may not be paused now (None: it may)."""
        reasons = self.blockers()
        return "; ".join(reasons) if reasons else None

    def blockers(self, max_age: float = 0.0) -> list[str]:
        """What keeps a pause from releasing all of this kernel's GPU memory safely, each
        in words a notebook user understands; empty when a pause would (or there is no
        memory to pause). Reused for ``max_age`` seconds (reports ask every second).

        Sources: the ``pause`` setting, code that may run while the kernel is idle
        (:func:`.idle_code.idle_code`), the pausable allocator's own figures (memory
        shared through CUDA IPC, managed memory, memory the driver allocated itself,
        :class:`~.pause.vmm.Figures`), PyTorch memory it does not know, and child
        processes of the kernel holding GPU memory (NVML). Never called while the kernel
        is suspended: every driver call of a suspended process waits for its restore.
        """
        now = time.monotonic()
        if self._blockers is not None and now - self._blockers[0] <= max_age:
            return self._blockers[1]
        reasons: list[str] = []
        if not self.config.pause:
            reasons.append("pausing is turned off (VGPUKernel.pause)")
        reasons += self._memory_blockers()
        self._blockers = (now, reasons)
        return reasons

    def idle_code(self) -> list[str]:
        """Code of the user's that may run while the kernel is idle, in words (a thread, a
        timer, an asyncio task, a GUI event loop: :func:`.idle_code.idle_code`). It keeps
        no kernel on the card: its GPU calls wait for the kernel to come back, and start
        its way back (the allocator's gate, ``native/gate.c``)."""
        loop = getattr(getattr(self.kernel, "io_loop", None), "asyncio_loop", None)
        return idle_code(loop, self.kernel)

    def _suspend_risk(self) -> list[str]:
        """Why code running between cells makes a suspend unsafe here (empty: it does
        not): where the allocator holds only its own entry points (not x86-64), a thread
        calling another driver function while the kernel is suspended would wait inside
        the driver's lock, with no way back but the next message."""
        allocator = self._allocator()
        if allocator is None or allocator.holds_every_call:
            return []
        return [
            f"{what} may call the GPU while the kernel is idle, and on this machine such a call "
            "would wait inside the driver's lock"
            for what in self.idle_code()
        ]

    def _memory_blockers(self) -> list[str]:
        """The memory reasons of :meth:`blockers`; those naming memory that may stay on the
        card while the rest of the kernel's is paused go to ``_staying`` too
        (:meth:`pauses_partly`)."""
        self._staying = set()
        if self.stand_in or not self._on_gpu():
            return []
        allocator = self._allocator()
        if allocator is None:
            return ["this kernel was not started with the pausable allocator (LD_PRELOAD)"]
        f = allocator.figures()
        out, staying = [], []
        if f.imported:
            mapped = format_bytes(f.imported)
            staying.append(f"{mapped} of another process's GPU memory is mapped in it ({CUDA_IPC})")
        for nbytes, what in (
            (f.exported, f"is shared with another process ({CUDA_IPC}, e.g. torch.multiprocessing)"),
            (f.managed, "is managed (unified) memory"),
            (f.let_through, "was allocated by CUDA itself (in a CUDA graph capture, or a pool of its own)"),
            (f.unmappable, "is mapped in pieces the allocator cannot restore"),
        ):
            if nbytes:
                staying.append(f"{format_bytes(nbytes)} of its GPU memory {what}")
        out += staying
        known = f.pausable + f.unpausable + f.async_cached
        torch = self._torch()
        reserved = 0
        if torch is not None and torch.cuda.is_initialized():
            with self._plain():
                reserved = torch.cuda.memory_reserved()
        if reserved > known:  # the engine refuses to pause around memory it does not know
            out.append(
                f"{format_bytes(reserved - known)} of PyTorch's GPU memory was allocated a way "
                "the pausable allocator does not cover"
            )
        children = [
            f"process {pid} ({_command(pid)}), started by this kernel, holds {format_bytes(n)} on the GPU"
            for pid, n in self.gpu_children().items()
        ]
        out += children
        self._staying = {*staying, *children}
        return out

    def _held_back(self) -> list[str]:
        """The reasons of the pause that took this kernel off in part ([] after a whole
        pause): the last :meth:`blockers`, which :meth:`pause` asked and nothing asks while
        the kernel is away (the driver may not be asked then)."""
        return list(self._blockers[1]) if self.gate.state == g.PAUSED and self._blockers else []

    def pauses_partly(self, reasons: list[str]) -> bool:
        """Whether a kernel held back by ``reasons`` (:meth:`blockers`, the same call's) is
        paused in part: the driver cannot suspend it (CUDA IPC, managed memory:
        :func:`_unsuspendable`), and every reason is memory that may stay on the card
        while the rest of the kernel's leaves. That is safe: none of the kernel's code runs
        while it is paused (no reason names code that runs on its own), and its IPC peers
        and child processes reach only what stays (an exported segment is never paused)."""
        return bool(reasons) and _unsuspendable(reasons) is not None and set(reasons) <= self._staying

    def gpu_children(self) -> dict[int, int]:
        """Processes this kernel started (at any depth) that hold GPU memory: ``{pid:
        bytes}`` (NVML's figures). They leave the GPU only with the kernel (suspended
        together): a worker of ``torch.multiprocessing``, a DataLoader worker using CUDA."""
        me = os.getpid()
        try:
            processes = self._gpu_processes()
        except Exception:  # NVML unavailable: nothing known of children
            return {}
        return {pid: n for pid, n in processes.items() if pid != me and me in _ancestors(pid)}

    def consequence(self, reasons: list[str]) -> str:
        """What happens to a kernel that cannot be paused for ``reasons``, in words."""
        why = _unsuspendable(reasons)
        if why and self.pauses_partly(reasons):
            return f"that memory stays on the GPU and the rest of this kernel's is paused ({why})"
        if why:
            return f"this kernel stays on the GPU: {why}"
        return "when the GPU is needed this kernel is suspended instead of paused"

    # -- the allocator's gate -------------------------------------------------------------

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
        return outcome

    def suspend_with_helper(self) -> None:
        """Suspend through a helper process (chaos mode ``suspend``, no arbiter): the driver
        checkpoints this process, with the child processes that hold GPU memory, from
        outside. The kernel must be paused or idle; an idle kernel is paused first when it
        can be (the checkpoint then moves only the CUDA context), else the checkpoint
        takes all of its memory.

        Raises:
            gate.Refused: the kernel is busy, or cannot be suspended (managed memory, CUDA
                IPC: the message says why).
            RuntimeError: the driver refused; the kernel stays as it was.
        """
        reasons = self.blockers() if self.gate.state == g.IDLE else self._held_back()
        why = _unsuspendable(reasons)
        risk = self._suspend_risk()
        if why or risk:
            self.last_refusal = (
                f"{'; '.join(reasons + risk)}; {self.consequence(reasons) if why else NOT_SUSPENDED}"
            )
            raise g.Refused(self.last_refusal)
        from .pause import vmm

        def work():
            if self.stand_in or not self._on_gpu():
                return  # no CUDA context: nothing to move
            self._close_gate(vmm.PAUSED)
            try:
                self._checkpoint_with_helper(reasons)
            except BaseException:
                self._open_gate()
                raise

        self.gate.away(work, to=g.SUSPENDED)
        self.last_refusal = f"{'; '.join(reasons)}; suspended instead of paused" if reasons else None

    def _checkpoint_with_helper(self, reasons: list[str]) -> None:
        """Pause what can be paused, then have a helper process suspend this one (and its
        children on the GPU) through the driver's checkpoint; every driver call of the
        kernel's threads is held from just before the checkpoint's lock."""
        from .pause import vmm

        if not reasons:
            with self._plain():
                engine = self._engine()
                if engine is not None and engine.state == PauseState.ACTIVE:
                    engine.pause()
        self._set_gate(vmm.SUSPENDED)
        children = sorted(self.gpu_children())
        self.suspend_need = checkpoint.footprint([*children, os.getpid()])
        pids = [*map(str, children), str(os.getpid())]
        cmd = [sys.executable, "-m", "jupyter_vgpu.host.checkpoint", "hold", *pids]
        # its own session: an interrupt of the kernel (SIGINT to the kernel's process
        # group) is not meant for it, and ending it would leave the kernel suspended
        helper = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        line = helper.stdout.readline().strip()
        if not line.startswith("suspended"):
            helper.wait(10)
            raise RuntimeError(f"suspending through the driver failed: {line or 'no answer'}")
        self.last_suspend_seconds = float(line.split()[1])
        self.suspended_with = children
        self._helper = helper

    # -- coming back ---------------------------------------------------------------------

    def prefetch(self) -> bool:
        """Bring this paused or suspended kernel back ahead of a cell its user is about to
        run (they opened, focused or edited its notebook: the server passes the word on
        through ``server.json``), if the card has room now: the node arbiter grants it
        only without taking anyone off the card, and at most once per
        ``prefetch_interval`` per user; without an arbiter, a paused kernel comes back
        where NVML shows room. Nothing is printed (no cell runs); a cell arriving
        meanwhile waits for it. True when the kernel came back; False when it was not
        away, or the prefetch was refused or failed (the kernel stays as it was, and its
        next cell brings it back as usual)."""
        try:
            return self.gate.back(lambda prior: self._come_back(prior, prefetch=True))
        except Exception as e:
            log.info("jupyter-vgpu: no prefetch: %s", e)
            return False

    def _come_back(self, state: str, prefetch: bool = False, woken: bool = False) -> None:
        """Called by the gate, in the thread of the first message that needs the kernel
        (or, ``woken``, of the kernel's own wake thread: a GPU call made between cells):
        room (from the arbiter, which restores a suspended kernel; without one, the
        kernel's own look at the card), then the memory back, then the GPU calls held
        meanwhile go on. Every wait longer than a second is shown in the cell's output
        (the last cell's, when woken), and kept up to date. A ``prefetch`` asks once,
        waits for nothing and prints nothing; one that fails leaves the held calls
        waiting for the next message; any other way back that fails makes them return an
        error that says why."""
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
            alone = self._room(purpose, progress, deadline, suspended=state == g.SUSPENDED)
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
        progress.done("room granted" if purpose == "run" else "back on the GPU")

    def _room(self, purpose: str, progress: Progress, deadline: float, suspended: bool = False) -> bool:
        """Room for the kernel: from the arbiter (False), or, with none to ask, decided here
        (True): a resident kernel runs, a paused or suspended one comes back once the card
        has room for it.

        Raises:
            MemoryError: the arbiter refused, or with no arbiter the card had no room
                before ``deadline``; the data stays on the host.
        """
        while True:
            if self.ask_room is None:
                return True
            try:
                self.ask_room(purpose, progress)
                return False
            except ArbiterUnavailable as e:
                if purpose == "run":
                    return True  # its memory is on the card already: it runs without the arbiter
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

    def _restore(self, progress: Progress, deadline: float, alone: bool) -> None:
        """Bring the process back from the driver's checkpoint. The arbiter restored it when
        it granted the room (``alone`` False); else its holder does: chaos mode's helper
        while it lives, a new helper (``checkpoint restore PID``) when the holder has ended
        (the helper, or an arbiter with no successor), retried until ``deadline`` while the
        driver finds no room.

        Raises:
            MemoryError: still no room at ``deadline``; the kernel stays suspended.
            RuntimeError: the driver refused otherwise.
        """
        helper, self._helper = self._helper, None
        if self.stand_in or not self._cuda_seen():
            return  # no CUDA context: nothing was checkpointed
        if helper is not None and helper.poll() is None:
            progress.update("restoring this kernel from the driver's checkpoint")
            line = progress.run(lambda: self._tell_helper(helper))
            if line.startswith("restored"):
                self.last_restore_seconds = float(line.split()[1])
                return
            if not alone:
                raise RuntimeError(f"restoring through the driver failed: {line or 'no answer'}")
        elif helper is not None:
            log.info(
                "jupyter-vgpu: the checkpoint helper ended (exit code %s); restoring anew", helper.returncode
            )
        if not alone:
            return  # the arbiter restored it before it granted the room
        pids = [*map(str, self.suspended_with), str(os.getpid())]  # as they were suspended
        need = [a for uuid, n in self.suspend_need.items() for a in ("--need", f"{uuid}={n}")]
        cmd = [sys.executable, "-m", "jupyter_vgpu.host.checkpoint", "restore", *need, *pids]
        while True:
            progress.update("restoring this kernel from the driver's checkpoint (its holder has ended)")
            done = progress.run(lambda: subprocess.run(cmd, capture_output=True, text=True, timeout=600))
            line = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr.strip()[-500:]
            if line.startswith("restored"):
                self.last_restore_seconds = float(line.split()[1])
                return
            if time.monotonic() >= deadline:
                raise MemoryError(
                    f"restoring this kernel from the driver's checkpoint failed ({line or 'no answer'}) "
                    f"for {self.config.resume_timeout:.0f} s; it stays suspended, its data kept in host "
                    "memory (the driver's checkpoint): run the cell again to retry"
                )
            progress.update(f"not restored yet ({line.removeprefix('failed ')}); trying again")
            progress.sleep(1.0)

    @staticmethod
    def _tell_helper(helper) -> str:
        try:
            helper.stdin.write("\n")
            helper.stdin.flush()
            line = helper.stdout.readline().strip()
            helper.wait(30)
        except (OSError, ValueError, subprocess.TimeoutExpired) as e:
            return f"failed {e}"
        return line

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

    def spill(self, directory: str) -> None:
        """For the arbiter: move this paused kernel's host memory to the disk tier, in
        ``directory`` (its own directory there); nothing to do for a kernel that holds
        nothing in host memory.

        Raises:
            RuntimeError: no directory was named.
            OSError: the disk refused (full, failing); the data stays in host memory.
        """
        if not directory:
            raise RuntimeError("no directory of the disk tier was named")
        if self.gate.state in (g.SUSPENDING, g.SUSPENDED):  # its CUDA calls wait for a restore
            raise RuntimeError("the kernel is suspended: its memory stays where the checkpoint left it")
        engine = self.engine
        if engine is None or engine.state != PauseState.PAUSED:
            return
        with self._plain():
            engine.spill(directory)

    def trim(self) -> int:
        """For the arbiter, when the host needs memory: let go of the pinned host memory
        kept warm for this kernel's next pause (that pause will pin again); returns the
        bytes given back.

        Raises:
            RuntimeError: the kernel is suspended (every CUDA call of it, freeing pinned
                memory included, waits for its restore).
        """
        if self.gate.state in (g.SUSPENDING, g.SUSPENDED):
            raise RuntimeError("the kernel is suspended: its pinned memory stays until its restore")
        self._trimmed = True  # until its next pause: the host needs the memory
        engine = self.engine
        if engine is None:
            return 0
        with self._plain():
            return engine.trim()

    def prepare_ahead(self) -> threading.Thread | None:
        """After a cell, while the kernel stays idle: once it has been idle
        ``prepare_after`` seconds, make the engine (nvCOMP, the codec's kernels) and pin
        the host memory its next pause stores into (:meth:`.pause.engine.PauseEngine.prepare`),
        in a thread of its own, so that a first pause costs what later ones cost. The
        thread stops before its next slab when the kernel leaves ``idle`` (a cell, a
        pause), when the arbiter asks for the memory back (:meth:`trim`; nothing is pinned
        ahead again until the kernel's next pause) or when the host's available memory
        would fall under a quarter of its total, or the host memory of the node's kernels
        pass half of the node arbiter's host budget (it trims from 80%: what a pause
        needs comes first). Only a kernel with an arbiter pins ahead: without one,
        nothing would count the memory or ask for it back, and only its user pauses it.
        The arbiter hears of each GiB pinned (a state message), so that its books count
        it. Returns the thread, or None when nothing is to be done (turned off, a
        simulated or unused GPU, already running)."""
        cfg = self.config
        if not (cfg.pause and cfg.prepare_pinned) or self._trimmed or self.gate.state != g.IDLE:
            return None
        if self._preparing is not None and self._preparing.is_alive():
            return None
        if self.stand_in or not self._cuda_seen():
            return None
        self._left_idle.clear()
        if self.gate.state != g.IDLE:  # left between the look and the clear
            return None
        self._preparing = run_in_thread(self._prepare, "prepare")
        return self._preparing

    def _prepare(self) -> None:
        left = self._left_idle
        if left.wait(self.config.prepare_after) or not self.node_figures():
            return  # a cell or a pause began; or no arbiter: nobody would count the memory
        allocator = self._allocator()
        if allocator is None or not any(u.mapped for u in allocator.segments()):
            return
        if self.blockers(max_age=5.0):  # suspended instead of paused: nothing to pin for
            return

        try:
            with self._plain():
                engine = self._engine()
                if engine is None or left.is_set():
                    return
                arena, t0 = engine.arena, time.perf_counter()
                start = arena.held_bytes
                made = engine.prepare(lambda: self._keep_pinning(arena, start))
            if made:
                self.gate.tell()  # the arbiter's books and the report count it now
                log.info(
                    "jupyter-vgpu: pinned %s ahead of the next pause in %.1f s",
                    format_bytes(made),
                    time.perf_counter() - t0,
                )
        except Exception as e:  # the next pause pins what it needs, as without this
            log.info("jupyter-vgpu: nothing pinned ahead: %s", e)

    def _keep_pinning(self, arena, start: int) -> bool:
        """Whether :meth:`_prepare` may pin another slab into ``arena``, which held
        ``start`` bytes when it began (the rules: :meth:`prepare_ahead`); tells the
        arbiter of each GiB pinned so far."""
        if self._left_idle.is_set() or self._trimmed:
            return False
        made = arena.held_bytes - start
        if made and made % (1 << 30) < arena.slab_bytes:  # another GiB: the arbiter counts it
            self.gate.tell()
        info = meminfo()
        total, available = info.get("MemTotal", 0), info.get("MemAvailable", 0)
        if available - arena.slab_bytes < total // 4:
            return False
        node = self.node_figures()  # None without an arbiter: nobody would count it
        return bool(node) and node["host_used"] + made + arena.slab_bytes <= node["host_limit"] // 2

    def prepare_suspend(self) -> None:
        """For the arbiter: pause (if not paused yet, and if a pause can release all of
        the kernel's memory) and hold every message; the arbiter then checkpoints the
        process, with the child processes that hold GPU memory, from outside, and
        restores it when a message comes.

        Raises:
            gate.Refused: the kernel is busy, pausing is turned off
                (``VGPUKernel.pause``), or the kernel cannot be suspended (managed memory,
                CUDA IPC: the message says why).
        """
        if not self.config.pause:
            raise g.Refused("pausing is turned off (VGPUKernel.pause)")
        reasons = self.blockers() if self.gate.state == g.IDLE else self._held_back()
        why = _unsuspendable(reasons)
        if why:
            self.last_refusal = f"{'; '.join(reasons)}; {self.consequence(reasons)}"
            raise g.Refused(self.last_refusal)

        risk = self._suspend_risk()
        if risk:
            self.last_refusal = f"{'; '.join(risk)}; {NOT_SUSPENDED}"
            raise g.Refused(self.last_refusal)
        if self.gate.state == g.IDLE:  # asked now: NVML waits once the process is checkpointed
            self.suspended_with = sorted(self.gpu_children())
        from .pause import vmm

        def work():
            self._close_gate(vmm.PAUSED)
            try:
                if not reasons:  # else the checkpoint takes all of the memory, context included
                    with self._plain():
                        engine = self._engine()
                        if engine is not None and engine.state == PauseState.ACTIVE:
                            engine.pause()
                if not self.stand_in:
                    self.suspend_need = checkpoint.footprint([*self.suspended_with, os.getpid()])
            except BaseException:
                self._open_gate()
                raise
            self._set_gate(vmm.SUSPENDED)  # every driver call waits from here: the arbiter locks next

        self.gate.away(work, to=g.SUSPENDED)
        self.last_refusal = f"{'; '.join(reasons)}; suspended instead of paused" if reasons else None

    # -- cells ---------------------------------------------------------------------------

    def pause_after_cell(self) -> None:
        """Take the kernel off the GPU once the running cell has ended (``%vgpu pause``):
        paused, or suspended where a pause is not safe (:meth:`take_off`)."""
        self._pause_after_cell = True

    def suspend_unavailable(self) -> str | None:
        """Why this kernel cannot be suspended here (None: it can): the driver's
        checkpoint needs CUDA 12.8+ and ``cuda-bindings``; it cannot move managed memory,
        and it cannot bring back a process that maps another's memory or lets another map
        its own through CUDA IPC (on the H100 with driver 580 it checkpointed such a
        process and then refused to restore it)."""
        reasons = self._blockers[1] if self._blockers is not None else []
        why = _unsuspendable(reasons)
        if why:
            return why
        if self.stand_in or not self._on_gpu():
            return None  # nothing on a GPU: a suspend is a stand-in
        from jupyter_vgpu.host import checkpoint

        return checkpoint.unavailable()

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

    def after(self, msg_type: str) -> None:
        """Called once a handler is done (in its thread): chaos mode and ``%vgpu pause``."""
        if msg_type != "execute_request" or self.gate.busy:
            return
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

    # -- figures -------------------------------------------------------------------------

    def stats(self) -> dict:
        """The kernel's pause figures for reports and ``%vgpu status``: ``state``,
        ``paused_bytes``, ``unpausable_bytes``, ``host_bytes``, ``ratio``, ``codec``,
        ``last_pause_seconds``, ``last_resume_seconds``, ``stand_in``, ``pausable`` (True,
        False, or None where nothing is known: a simulated GPU, no CUDA yet),
        ``not_pausable`` (why not and what happens instead, or None), ``between_cells``
        (code of the user's that may run between cells, in words, or None),
        ``unavailable``, ``refused``."""
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
        )
        return out


#: How the blockers name memory shared between processes.
CUDA_IPC = "CUDA IPC"
#: What happens to a kernel whose code between cells makes a suspend unsafe.
NOT_SUSPENDED = "this kernel is paused when the GPU is needed, never suspended"


def _unsuspendable(reasons: list[str]) -> str | None:
    """Why the driver's checkpoint cannot take a kernel blocked by ``reasons`` (None: it can)."""
    if any("managed (unified) memory" in r for r in reasons):
        return "the driver can neither pause nor suspend managed memory"
    if any(CUDA_IPC in r for r in reasons):
        return "the driver cannot bring back a process that shares GPU memory with another through CUDA IPC"
    return None


def _ancestors(pid: int, limit: int = 64) -> list[int]:
    """``pid``'s parent, grandparent... (from ``/proc``), nearest first."""
    chain = []
    while pid > 1 and len(chain) < limit:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            break
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])  # the name may hold ')' and spaces
        chain.append(pid)
    return chain


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return "?"
    text = " ".join(a.decode(errors="replace") for a in argv if a)
    return text if len(text) <= 60 else text[:57] + "..."


def _torch_module():
    import torch

    return torch


def run_in_thread(fn: Callable[[], None], name: str) -> threading.Thread:
    """Start ``fn`` in a daemon thread named for this package (not user code)."""
    t = threading.Thread(target=fn, name=f"jupyter-vgpu-{name}", daemon=True)
    t.start()
    return t
