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
run for real, no memory moves, and the figures say so.
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

from . import gate as g
from .idle_code import idle_code

log = logging.getLogger("jupyter_vgpu")


class PauseControl:
    """Pauses, suspends and resumes one kernel.

    Args:
        config: the kernel's :class:`~.config.VGPUKernel` settings.
        torch_module: returns the torch module, or None while it is not imported.
        simulated: returns True when the slice's GPU is simulated (stand-in pauses).
        kernel: the ipykernel ``Kernel`` (its event loop is checked for idle code), or None.
        say: shows a line in the running cell's output (waiting for room).
    """

    def __init__(
        self,
        config,
        torch_module: Callable[[], object],
        simulated: Callable[[], bool],
        kernel=None,
        say: Callable[[str], None] = lambda text: None,
    ):
        self.config = config
        self._torch = torch_module
        self._simulated = simulated
        self.kernel = kernel
        self.say = say
        self.gate = g.Gate(self._come_back, on_change=self._changed)
        self.engine = None
        self.unavailable: str | None = None  # why memory cannot be paused here
        self.last_refusal: str | None = None
        self.last_error: str | None = None  # why the last pause after a cell failed
        self.last_notice: str | None = None  # the node arbiter's last word (over budget)
        #: asks the node arbiter for room, blocking: ("run" | "resume" | "restore") -> None;
        #: raises MemoryError when it refuses. Set by the arbiter client.
        self.ask_room: Callable[[str], None] | None = None
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
            return None
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
            # its own session: the kernel's interrupts (SIGINT to its process group) are not for it
            helper = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
            )
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
        room from the arbiter (which restores a suspended kernel), then the memory back."""
        if self.ask_room is not None:
            self.ask_room({g.SUSPENDED: "restore", g.PAUSED: "resume"}.get(state, "run"))
        elif state == g.SUSPENDED:
            self._restore()
        engine = self.engine
        if engine is None or engine.state != "paused":
            return
        with self._plain():
            self._resume_engine(engine)

    def _resume_engine(self, engine) -> None:
        from .pause import vmm

        deadline = time.monotonic() + self.config.resume_timeout
        told = False
        while True:
            try:
                engine.resume()
                return
            except vmm.DeviceFull:
                need = engine.room_needed()
                if self.ask_room is not None:
                    self.ask_room("resume")  # room the arbiter saw was taken meanwhile: ask again
                    continue
                if time.monotonic() > deadline:
                    raise MemoryError(
                        f"the GPU has no room to bring this kernel back ({need / 2**30:.2f} GiB needed) "
                        f"after {self.config.resume_timeout:.0f} s; its data is kept in host memory"
                    ) from None
                if not told:
                    self.say(f"jupyter-vgpu: waiting for {need / 2**30:.2f} GiB free on the GPU to resume")
                    told = True
                time.sleep(1.0)

    def _restore(self) -> None:
        helper, self._helper = self._helper, None
        if helper is not None:
            helper.stdin.write("\n")
            helper.stdin.flush()
            line = helper.stdout.readline().strip()
            helper.wait(30)
            if not line.startswith("restored"):
                raise RuntimeError(f"restoring through the driver failed: {line or 'no answer'}")
            self.last_restore_seconds = float(line.split()[1])

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


def run_in_thread(fn: Callable[[], None], name: str) -> threading.Thread:
    """Start ``fn`` in a daemon thread named for this package (not user code)."""
    t = threading.Thread(target=fn, name=f"jupyter-vgpu-{name}", daemon=True)
    t.start()
    return t
