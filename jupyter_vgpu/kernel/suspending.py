"""Suspending a kernel through the driver's process checkpoint, and restoring it.

:class:`Suspending` is a part of :class:`~.pausing.PauseControl` (its state: ``_helper``,
the checkpoint helper process of chaos mode and ``%vgpu pause``; ``suspended_with``, the
child processes suspended with the kernel; ``suspend_need``, the bytes per card they held;
``last_suspend_seconds``, ``last_restore_seconds``). A suspend pauses what a pause can
release first (the checkpoint then moves only the CUDA context), holds every driver call
of the kernel's threads, and has the checkpoint taken from outside: by the node arbiter
(:meth:`Suspending.prepare_suspend`) or by a helper process of the kernel's own
(:meth:`Suspending.suspend_with_helper`, ``python -m jupyter_vgpu.host.checkpoint
hold``), whose end leaves a new helper to restore it (``checkpoint restore``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

from jupyter_vgpu.host import checkpoint

from . import gate as g
from .blockers import NOT_SUSPENDED, unsuspendable
from .pause.states import PauseState
from .progress import Progress

log = logging.getLogger("jupyter_vgpu")


class Suspending:
    """The driver's checkpoint of a :class:`~.pausing.PauseControl`'s kernel, taken and given back."""

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
        why = unsuspendable(reasons)
        risk = self._suspend_risk()
        if why or risk:
            self.last_refusal = (
                f"{'; '.join(reasons + risk)}; {self.consequence(reasons) if why else NOT_SUSPENDED}"
            )
            raise g.Refused(self.last_refusal)
        from .pause import vmm

        def work():
            self.before_suspend()
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

    def prepare_suspend(self) -> None:
        """For the arbiter: pause (if not paused yet, and if a pause can release all of
        the kernel's memory) and hold every message; the arbiter then checkpoints the
        process, with the child processes that hold GPU memory, from outside, and
        restores it when a message comes.

        Raises:
            gate.Refused: the kernel is busy, or cannot be suspended (managed memory,
                CUDA IPC: the message says why). A kernel with pausing turned off
                (``VGPUKernel.pause``, a setting its user may write) is suspended whole:
                nothing the user writes keeps a kernel on the card.
        """
        reasons = self.blockers() if self.gate.state == g.IDLE else self._held_back()
        why = unsuspendable(reasons)
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
                self.before_suspend()
                if not self.stand_in:
                    self.suspend_need = checkpoint.footprint([*self.suspended_with, os.getpid()])
            except BaseException:
                self._open_gate()
                raise
            self._set_gate(vmm.SUSPENDED)  # every driver call waits from here: the arbiter locks next

        self.gate.away(work, to=g.SUSPENDED)
        self.last_refusal = f"{'; '.join(reasons)}; suspended instead of paused" if reasons else None

    def suspend_unavailable(self) -> str | None:
        """Why this kernel cannot be suspended here (None: it can): the driver's
        checkpoint needs CUDA 12.8+ and ``cuda-bindings``; it cannot move managed memory,
        and it cannot bring back a process that maps another's memory or lets another map
        its own through CUDA IPC (on the H100 with driver 580 it checkpointed such a
        process and then refused to restore it)."""
        reasons = self._blockers[1] if self._blockers is not None else []
        why = unsuspendable(reasons)
        if why:
            return why
        if self.stand_in or not self._on_gpu():
            return None  # nothing on a GPU: a suspend is a stand-in
        from jupyter_vgpu.host import checkpoint

        return checkpoint.unavailable()

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
