"""When and how this kernel pauses, suspends and comes back.

Ties the :class:`~.gate.Gate` (no code runs while memory is away) to the
:class:`~.pause.engine.PauseEngine` (the memory itself) and to the driver's checkpoint
(the whole process). Pauses are asked for by the node arbiter (to make room for
another kernel), by ``%vgpu pause`` (once the cell ends) and by chaos mode (after
every cell). A pause is refused while the kernel runs a message, and while code of the
user's could run on its own (:mod:`.idle_code`): a thread, a timer, an asyncio task, a
GUI event loop.

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

from jupyter_vgpu.units import format_bytes

from . import gate as g
from .arbiter_client import ArbiterUnavailable
from .idle_code import idle_code
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
    ):
        self.config = config
        self._torch = torch_module
        self._simulated = simulated
        self.kernel = kernel
        self.say = say
        self.card_free = card_free
        self.gate = g.Gate(self._come_back, on_change=self._changed, on_wait=self._while_busy)
        self._waits = threading.local()
        self.engine = None
        self.unavailable: str | None = None  # why memory cannot be paused here
        self.last_refusal: str | None = None
        self.last_error: str | None = None  # why the last pause after a cell failed
        self.last_notice: str | None = None  # the node arbiter's last word (over budget)
        #: asks the node arbiter for room, blocking: (purpose, progress) -> None, purpose
        #: "run" | "resume" | "restore"; raises MemoryError when it refuses and
        #: ArbiterUnavailable when there is no arbiter. Set by the arbiter client.
        self.ask_room: Callable[..., None] | None = None
        self.listeners: list[Callable[[str], None]] = []
        self._helper: subprocess.Popen | None = None
        self._pause_after_cell = False
        self.last_suspend_seconds: float | None = None
        self.last_restore_seconds: float | None = None

    # -- state ---------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``active`` (running a message), ``idle``, ``paused``, ``suspended``, or a
        transition (``pausing``, ``suspending``, ``resuming``)."""
        s = self.gate.state
        return "active" if s == g.BUSY else s

    def _changed(self, state: str) -> None:
        for listener in list(self.listeners):
            try:
                listener(state)
            except Exception:
                log.exception("jupyter-vgpu: a state listener failed")

    # -- the engine ----------------------------------------------------------------------

    def _engine(self):
        """The engine, made on first use; None while the GPU holds nothing of this kernel."""
        if self.engine is not None:
            return self.engine
        torch = self._torch()
        if self.stand_in:
            return self._host_engine()
        if not torch.cuda.is_initialized():
            return None  # no CUDA context, no memory: nothing to pause
        from .pause import vmm
        from .pause.engine import PauseEngine

        try:
            allocator = vmm.load()
        except vmm.VMMUnavailable as e:
            self.unavailable = str(e)
            return None
        if not allocator.preloaded:
            self.unavailable = (
                "this kernel was not started with the pausable allocator "
                "(start it from a jupyter-vgpu server, which sets LD_PRELOAD)"
            )
            return None
        cfg = self.config
        self.engine = PauseEngine(
            torch,
            allocator,
            torch.cuda.current_device(),
            use_nvcomp=cfg.use_nvcomp,
            scratch_bytes=cfg.scratch_bytes,
            host_cap_bytes=cfg.host_cap_bytes,
            spill_dir=cfg.spill_dir or None,
        )
        return self.engine

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
        """True on a simulated GPU or without CUDA: pauses move no memory."""
        torch = self._torch()
        return bool(self._simulated() or torch is None or not torch.cuda.is_available())

    # -- going away ----------------------------------------------------------------------

    def check(self) -> str | None:
        """Why this kernel may not be paused now (None: it may)."""
        if not self.config.pause:
            return "pausing is turned off (VGPUKernel.pause)"
        loop = getattr(getattr(self.kernel, "io_loop", None), "asyncio_loop", None)
        found = idle_code(loop, self.kernel)
        if found:
            return "code of the kernel's may run while it is idle: " + "; ".join(found)
        return None

    def pause(self) -> dict:
        """Pause the kernel now (it must be idle); returns the engine's figures.

        Raises:
            gate.Refused: the kernel is not idle, or runs code of its own while idle.
            PauseError: the pause failed and was undone.
        """
        reason = self.check()
        if reason:
            self.last_refusal = reason
            raise g.Refused(reason)
        outcome = {}

        def work():
            with self._plain():
                engine = self._engine()
                if engine is not None:
                    outcome["pause"] = engine.pause()

        self.gate.away(work, to=g.PAUSED)
        self.last_refusal = None
        return outcome

    def suspend_with_helper(self) -> None:
        """Suspend through a helper process (chaos mode ``suspend``, no arbiter): the driver
        checkpoints this process from outside. The kernel must be paused or idle.

        Raises:
            gate.Refused: the kernel is busy.
            RuntimeError: the driver refused; the kernel stays as it was.
        """

        def work():
            if self._torch() is None or not self._torch().cuda.is_initialized():
                return  # no CUDA context: nothing to move
            cmd = [sys.executable, "-m", "jupyter_vgpu.node.checkpoint", "hold", str(os.getpid())]
            helper = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            line = helper.stdout.readline().strip()
            if not line.startswith("suspended"):
                helper.wait(10)
                raise RuntimeError(f"suspending through the driver failed: {line or 'no answer'}")
            self.last_suspend_seconds = float(line.split()[1])
            self._helper = helper

        self.gate.away(work, to=g.SUSPENDED)

    # -- coming back ---------------------------------------------------------------------

    def _come_back(self, state: str) -> None:
        """Called by the gate, in the thread of the first message that needs the kernel:
        room (from the arbiter, which restores a suspended kernel; without one, the
        kernel's own look at the card), then the memory back. Every wait longer than a
        second is shown in the cell's output, and kept up to date."""
        purpose = {g.SUSPENDED: "restore", g.PAUSED: "resume"}.get(state, "run")
        what = {
            "run": "asking the node arbiter for room on the GPU",
            "resume": "this kernel is paused: asking the node arbiter for room on the GPU to bring it back",
            "restore": "this kernel is suspended: asking the node arbiter to restore it",
        }[purpose]
        progress = Progress(self.say, what)
        deadline = time.monotonic() + self.config.resume_timeout
        try:
            alone = self._room(purpose, progress, deadline)
            if state == g.SUSPENDED:
                self._restore(progress, deadline, alone)
            engine = self.engine
            if engine is not None and engine.state == "paused":
                with self._plain():
                    self._resume_engine(engine, progress, deadline)
        except BaseException as e:
            progress.done(f"not brought back: {e}" if isinstance(e, Exception) else None)
            raise
        progress.done("room granted" if purpose == "run" else "back on the GPU")

    def _room(self, purpose: str, progress: Progress, deadline: float) -> bool:
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
        if engine is None or engine.state != "paused" or engine.device is None:
            return 0, None
        need = engine.room_needed()
        try:
            free = self.card_free()
        except Exception:
            free = None
        return need, free

    def _resume_engine(self, engine, progress: Progress, deadline: float) -> None:
        from .pause import vmm

        while True:
            where = "disk" if engine.disk_bytes() else "host memory"
            progress.update(f"bringing {format_bytes(engine.paused_bytes)} back to the GPU from {where}")
            try:
                progress.run(engine.resume)
                return
            except vmm.DeviceFull:
                need = engine.room_needed()
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
        torch = self._torch()
        if torch is None or not torch.cuda.is_initialized():
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
        cmd = [sys.executable, "-m", "jupyter_vgpu.node.checkpoint", "restore", str(os.getpid())]
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
                    f"for {self.config.resume_timeout:.0f} s; it stays suspended: run the cell again to retry"
                )
            progress.update(f"the driver could not restore this kernel yet ({line}); trying again")
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
        if engine is None or engine.state != "paused":
            return
        with self._plain():
            engine.spill(directory)

    def prepare_suspend(self) -> None:
        """For the arbiter: pause (if not paused yet) and hold every message; the arbiter
        then checkpoints the process from outside and restores it when a message comes.

        Raises:
            gate.Refused: the kernel is busy, or code of its own may run while idle.
        """
        if self.gate.state == g.IDLE:
            reason = self.check()
            if reason:
                self.last_refusal = reason
                raise g.Refused(reason)

        def work():
            with self._plain():
                engine = self._engine()
                if engine is not None and engine.state == "active":
                    engine.pause()

        self.gate.away(work, to=g.SUSPENDED)

    # -- cells ---------------------------------------------------------------------------

    def pause_after_cell(self) -> None:
        """Pause once the running cell has ended (``%vgpu pause``)."""
        self._pause_after_cell = True

    def after(self, msg_type: str) -> None:
        """Called once a handler is done (in its thread): chaos mode and ``%vgpu pause``."""
        if msg_type != "execute_request" or self.gate.busy:
            return
        wanted = self._pause_after_cell or self.config.chaos
        self._pause_after_cell = False
        if not wanted:
            return
        try:
            self.pause()
            if self.config.chaos == "suspend":
                self.suspend_with_helper()
            self.last_error = None
        except g.Refused as e:
            log.info("jupyter-vgpu: no pause after this cell: %s", e)
        except Exception as e:
            self.last_error = f"{type(e).__name__}: {e}"
            log.warning("jupyter-vgpu: the pause after this cell failed: %s", self.last_error)

    # -- figures -------------------------------------------------------------------------

    def stats(self) -> dict:
        """The kernel's pause figures for reports and ``%vgpu status``: ``state``,
        ``paused_bytes``, ``host_bytes``, ``ratio``, ``codec``, ``last_pause_seconds``,
        ``last_resume_seconds``, ``stand_in``, ``unavailable``, ``refused``."""
        out = {
            "state": self.state,
            "paused_bytes": 0,
            "live_bytes": 0,
            "host_bytes": 0,
            "disk_bytes": 0,
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
        out.update(
            stand_in=self.stand_in,
            unavailable=self.unavailable,
            refused=self.last_refusal,
            error=self.last_error,
            last_suspend_seconds=self.last_suspend_seconds,
            last_restore_seconds=self.last_restore_seconds,
        )
        return out


def _torch_module():
    import torch

    return torch


def run_in_thread(fn: Callable[[], None], name: str) -> threading.Thread:
    """Start ``fn`` in a daemon thread named for this package (not user code)."""
    t = threading.Thread(target=fn, name=f"jupyter-vgpu-{name}", daemon=True)
    t.start()
    return t
