"""What keeps a pause from releasing all of this kernel's GPU memory safely, and what
happens to such a kernel instead.

:class:`Blockers` is a part of :class:`~.pausing.PauseControl` (its state: ``_blockers``,
the last reasons and when they were found, ``_staying``, those of them naming memory
that may stay on the card). It names, in a notebook user's words, memory the pausable
allocator knows and cannot pause (CUDA IPC, managed memory, memory the driver allocated
itself), PyTorch memory the allocator does not know, child processes holding GPU memory,
and code of the user's that runs between cells; and decides from them whether the
kernel is paused whole, paused in part (what is shared or managed stays), suspended, or
stays on the card (:meth:`Blockers.consequence`).
"""

from __future__ import annotations

import os
import time

from jupyter_vgpu.units import format_bytes

from . import gate as g
from .idle_code import idle_code


class Blockers:
    """The reasons a :class:`~.pausing.PauseControl` may not pause whole, and their consequence."""

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
        out, staying = [], []
        if allocator is None:
            return [*out, "this kernel was not started with the pausable allocator (LD_PRELOAD)"]
        f = allocator.figures()
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
        :func:`unsuspendable`), and every reason is memory that may stay on the card
        while the rest of the kernel's leaves. That is safe: none of the kernel's code runs
        while it is paused (no reason names code that runs on its own), and its IPC peers
        and child processes reach only what stays (an exported segment is never paused)."""
        return bool(reasons) and unsuspendable(reasons) is not None and set(reasons) <= self._staying

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
        why = unsuspendable(reasons)
        if why and self.pauses_partly(reasons):
            return f"that memory stays on the GPU and the rest of this kernel's is paused ({why})"
        if why:
            return f"this kernel stays on the GPU: {why}"
        return "when the GPU is needed this kernel is suspended instead of paused"


#: How the blockers name memory shared between processes.
CUDA_IPC = "CUDA IPC"
#: What happens to a kernel whose code between cells makes a suspend unsafe.
NOT_SUSPENDED = "this kernel is paused when the GPU is needed, never suspended"


def unsuspendable(reasons: list[str]) -> str | None:
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
