"""The host memory of this kernel's pauses: pinned ahead while it is idle, let go or
moved to the node's disk tier when the node arbiter asks.

:class:`HostMemory` is a part of :class:`~.pausing.PauseControl` (its state:
``_preparing``, the thread pinning ahead; ``_left_idle``, set whenever the kernel leaves
``idle``; ``_trimmed``, the arbiter took the warm slabs back). A kernel's first pause
pins the pinned slabs it stores into on the way (slow); once it has been idle a while
after a cell, a thread pins them ahead (:meth:`HostMemory.prepare_ahead`) within the
node's host budget. The arbiter asks for them back (:meth:`HostMemory.trim`) when the
host needs memory, and moves a paused kernel's data to disk (:meth:`HostMemory.spill`).
Once paused, the kernel gives back on its own what its process holds and needs for
nothing until its next cell (:meth:`HostMemory.trim_while_paused`).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time

from jupyter_vgpu.host import procs
from jupyter_vgpu.host.meminfo import meminfo
from jupyter_vgpu.units import format_bytes

from . import gate as g
from .held_calls import run_in_thread
from .pause.states import PauseState

log = logging.getLogger("jupyter_vgpu")


class HostMemory:
    """The pause's host memory of a :class:`~.pausing.PauseControl`: pinned ahead, trimmed, spilled."""

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
        """For the arbiter, when the host needs memory (an idle kernel, or a paused one
        while the host's available memory is short): let go of the pinned host memory
        kept warm for this kernel's next pause (that pause will pin again) and of the
        engine's pinned staging (:meth:`.pause.engine.PauseEngine.trim`), then of the free
        pages of the C heap (``malloc_trim(0)``); returns the pinned bytes given back.
        Once paused, its figures are :attr:`last_trim`, as :meth:`trim_while_paused`'s
        (the arbiter measures the process from outside before and after, too).

        Raises:
            RuntimeError: the kernel is suspended (every CUDA call of it, freeing pinned
                memory included, waits for its restore).
        """
        if self.gate.state in (g.SUSPENDING, g.SUSPENDED):
            raise RuntimeError("the kernel is suspended: its pinned memory stays until its restore")
        self._trimmed = True  # until its next pause: the host needs the memory
        t0, before = time.perf_counter(), procs.private_bytes("self")
        slabs = 0
        engine = self.engine
        if engine is not None:
            with self._plain():
                slabs = engine.trim()
        _malloc_trim()
        if self.gate.state == g.PAUSED:  # "given back when last paused" in %vgpu status
            self._record_trim(before, slabs, t0)
        return slabs

    def trim_while_paused(self) -> threading.Thread | None:
        """Once the kernel is paused: give the host back what its process holds and needs
        for nothing until its next cell, in a thread of its own (the pause's answer does
        not wait for it): first its paused pieces, offered to the node's pieces held once
        (:meth:`.pause.engine.PauseEngine.share`; the slabs they leave go back), then
        the pinned slabs kept warm past those that hold its paused data
        (:meth:`.pause.engine.PauseEngine.trim`: its next pause pins them again, or pins
        ahead once the kernel is idle after a cell, :meth:`prepare_ahead`), PyTorch's
        cache of pinned memory with them, and the free pages inside the C heap (glibc's
        ``malloc_trim(0)``: freed memory below the heap's top, which ``free`` keeps,
        as after a cell that built and dropped many small objects). Its figures are
        :attr:`last_trim`: ``private_before`` and ``private_after`` (the process's own
        resident memory, :func:`jupyter_vgpu.host.procs.private_bytes`, bytes),
        ``slabs`` (pinned bytes let go) and ``seconds``. Returns the thread, or None when
        turned off (``VGPUKernel.trim_when_paused``, and no pieces to share) or not paused."""
        sharing = self._shared_pieces()
        if not (self.config.trim_when_paused or sharing) or self.gate.state != g.PAUSED:
            return None
        self._trimming = run_in_thread(self._trim_paused, "trim")
        return self._trimming

    def _shared_pieces(self):
        """The engine's :class:`.pause.sharing.PieceSharing`, or None (no engine, sharing
        off, or an engine of several cards, which keeps its pieces)."""
        return getattr(self.engine, "sharing", None)

    def let_go_shared(self) -> threading.Thread | None:
        """After a cell, once the kernel is back on the GPU: close, in a thread of its own,
        the mappings of the node's shared pieces its resume read, and drop its references
        to them at the arbiter (:meth:`.pause.engine.PauseEngine.let_go_shared`); the
        arbiter hears of the host memory given back. The thread stops at the next
        mapping once a cell begins (the rest wait for the end of that cell): each close
        unregisters pinned memory (``cudaHostUnregister``: it unpins the pages and takes
        the driver's locks of the process). Closed right after the resume, beside the
        cell, as until this change, the cells of 44 transformer sessions sharing one
        checkpoint took 1.28 s of their own time (p50) where the same cells took 0.95 s
        without sharing (``benchmarks/results/sessions-h100.json``; the let-go's part in
        that was not measured apart). Returns the thread, or None: nothing to let go."""
        sharing = self._shared_pieces()
        if sharing is None or not sharing.retired or self.gate.busy:
            return None
        return run_in_thread(self._let_go_shared, "let-go")

    def _let_go_shared(self) -> None:
        try:
            with self._plain():
                closed = self.engine.let_go_shared(lambda: not self.gate.busy)
        except Exception as e:  # the arbiter drops the references when the kernel ends
            log.info("jupyter-vgpu: shared pieces not let go: %s", e)
            return
        if closed:
            self.gate.tell()

    def trimmed(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the trim after a pause to end (its offers of
        pieces stop once the kernel leaves ``paused``): before the driver's checkpoint
        locks the process, no thread of the package's own may be in a driver call it
        started (freeing or registering pinned memory), holding the engine's lock."""
        trimming = self._trimming
        if trimming is not None and trimming is not threading.current_thread():
            trimming.join(timeout)

    def before_suspend(self) -> None:
        """Before the driver's checkpoint locks the process: wait for the trim after a
        pause (:meth:`trimmed`, up to ``gate_timeout``), then give back the free pages of
        the C heap (``malloc_trim(0)``, no driver call: the checkpoint takes the device
        memory, and the process's own memory stays while it is suspended); its figures in
        :attr:`last_trim`, as :meth:`trim_while_paused`'s. The heap is left as it is when
        ``VGPUKernel.trim_when_paused`` is off."""
        self.trimmed(self.config.gate_timeout)
        sharing = self._shared_pieces()
        if sharing is not None:  # the checkpoint is not told of memory registered as pinned
            with self._plain(), self.own_calls():
                sharing.unpin()
        if self.config.trim_when_paused:
            self._trim_paused(slabs_too=False)

    def _trim_paused(self, slabs_too: bool = True) -> None:
        t0 = time.perf_counter()
        before = procs.private_bytes("self")
        slabs = 0
        try:
            engine = self.engine
            if slabs_too and self._shared_pieces() is not None:
                with self._plain():
                    slabs += engine.share(lambda: self.gate.state == g.PAUSED)
            trim = slabs_too and self.config.trim_when_paused
            if trim and engine is not None and self.gate.state == g.PAUSED:  # not while coming back
                with self._plain():
                    slabs += engine.trim()
        except Exception as e:  # the slabs stay warm; the heap is trimmed all the same
            log.info("jupyter-vgpu: the paused kernel's pinned slabs stay: %s", e)
        if slabs:
            self.gate.tell()  # the arbiter's books and the report count what is left
        if self.config.trim_when_paused:
            _malloc_trim()
        self._record_trim(before, slabs, t0)

    def _record_trim(self, before: int | None, slabs: int, t0: float) -> None:
        """Keep a trim's figures in :attr:`last_trim` and log them (``before``: the
        process's own memory before it, bytes; ``t0``: its start, ``perf_counter``)."""
        after = procs.private_bytes("self")
        self.last_trim = {
            "private_before": before,
            "private_after": after,
            "slabs": slabs,
            "seconds": time.perf_counter() - t0,
        }
        if before is not None and after is not None:
            log.info(
                "jupyter-vgpu: away; the process gave back %s of its own memory (%s left) in %.2f s",
                format_bytes(max(before - after, 0)),
                format_bytes(after),
                self.last_trim["seconds"],
            )

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


def _malloc_trim() -> None:
    """Give the C heap's free pages back to the system: glibc's ``malloc_trim(0)``
    (``man 3 malloc_trim``: since glibc 2.8 it releases free pages anywhere in the heap,
    not only at its top); nothing where the C library has no such call (musl)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
