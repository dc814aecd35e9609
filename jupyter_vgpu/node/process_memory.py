"""Each kernel process's own host memory, measured by the arbiter from outside it.

A kernel's process holds host memory beside its paused data: its libraries, its Python
objects, the pinned memory it keeps for its pauses (about 1.4 GB for a transformer
kernel, issue 42). The arbiter reads it from ``/proc`` (:func:`jupyter_vgpu.host.procs.memory`),
never from what the kernel says: RSS, PSS (each page shared with other processes
divided among them: the pages of PyTorch's and CUDA's libraries are shared by every
kernel, and RSS counts them in each), anonymous, file and shared memory.

``smaps_rollup``, which gives the PSS, walks the process's page tables: about 9 ms for a
process that imported torch and 30 to 60 ms at 1 to 3 GiB resident (measured on a
2-core VM), so neither the books (asked by the Hub's page and by benchmarks in a loop)
nor the event loop read it. :class:`ProcessMemory` reads every kernel in a thread every
``ArbiterApp.process_memory_seconds`` (a kernel never read is read at the next poll);
the books show the latest figures with their age, and the gauge
``jupyter_vgpu_kernel_process_pss_bytes{tier}`` their sum by tier.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING

from jupyter_vgpu.host import procs

from .books import TIERS, Kernel

if TYPE_CHECKING:
    from .arbiter import Arbiter


def _read(kernel: Kernel) -> procs.Memory | None:
    """``kernel``'s process's figures; None when it is gone or its PID changed hands."""
    ident = kernel.identity
    if ident is not None and not ident.current():
        return None
    return procs.memory(kernel.pid)


class ProcessMemory:
    """The arbiter's looks at its kernels' processes' host memory (:mod:`.process_memory`)."""

    def __init__(self, arbiter: Arbiter):
        self.arbiter = arbiter
        self._looking: asyncio.Future | None = None
        self._looked = -math.inf  # monotonic seconds of the last look at every kernel

    def step(self, now: float) -> None:
        """Start a look in a thread (``now``: monotonic seconds) at every kernel once
        ``process_memory_seconds`` have passed since the last, else at those never looked
        at; nothing while a look runs."""
        if self._looking is not None and not self._looking.done():
            return
        kernels = self.arbiter.kernels
        every = getattr(self.arbiter.config, "process_memory_seconds", 10.0)
        if now - self._looked >= every:
            self._looked = now
        else:
            kernels = [k for k in kernels if k.process is None]
        if kernels:
            self._looking = asyncio.ensure_future(self.look(kernels))

    async def look(self, kernels: list[Kernel]) -> None:
        """Read the processes of ``kernels`` in a thread, keep each one's figures
        (:attr:`.books.Kernel.process`), and publish the gauge."""
        loop = asyncio.get_running_loop()
        figures = await loop.run_in_executor(None, lambda: [_read(k) for k in kernels])
        now = time.monotonic()
        for kernel, memory in zip(kernels, figures, strict=True):
            if memory is not None:
                kernel.process, kernel.process_at = memory, now
        pss = dict.fromkeys(TIERS, 0)
        for kernel in self.arbiter.kernels:
            if kernel.process is not None and kernel.process.pss is not None:
                pss[kernel.tier] += kernel.process.pss
        for tier, total in pss.items():
            self.arbiter.metrics.process_pss.labels(tier=tier).set(total)

    @staticmethod
    def figures(kernel: Kernel, now: float) -> dict | None:
        """What the books show of ``kernel``'s process (``now``: monotonic seconds):
        :meth:`.procs.Memory.as_dict` (``rss_bytes``, ``pss_bytes``, ``anon_bytes``,
        ``file_bytes``, ``shmem_bytes``, ``swap_bytes``, ``locked_bytes``,
        ``pss_anon_bytes``, ``pss_file_bytes``, ``pss_shmem_bytes``, ``source``) and
        ``age_seconds``, how long ago it was read; None before the first look."""
        if kernel.process is None:
            return None
        return {**kernel.process.as_dict(), "age_seconds": round(now - kernel.process_at, 3)}
