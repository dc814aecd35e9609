"""The way to this kernel's GPU memory: the pausable allocator, the pause engine, and
whether the kernel is on a GPU at all.

:class:`MemoryPath` is a part of :class:`~.pausing.PauseControl` (its state: ``engine``,
made under ``_engine_lock``; ``_allocator_found``; ``unavailable``, why no memory can be
paused here). It owns:

- the pausable allocator (``native/``), looked up once: there only where the process was
  started with it (LD_PRELOAD);
- the :class:`~.pause.engine.PauseEngine`, made on first use once the kernel holds GPU
  memory (over the allocator's host backend where code made segments without a GPU), or
  a :class:`~.pause.devices.DevicesEngine` where the kernel sees several devices (a slice
  of several cards): one engine per device, paused and resumed as one;
- whether the kernel has a CUDA context (PyTorch's word, the allocator's, NVML's), and
  whether its pauses are stand-ins (a simulated GPU, PyTorch without CUDA), which move
  no memory;
- :meth:`MemoryPath._plain`: PyTorch calls of this package unseen by a user's modes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

from jupyter_vgpu.host.socket_path import SOCKET_ENV

log = logging.getLogger("jupyter_vgpu")


class MemoryPath:
    """The pausable allocator and the engine of a :class:`~.pausing.PauseControl`."""

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

    def grow_with(self, socket_path: str | None) -> bool:
        """Have the pausable allocator ask the node arbiter at ``socket_path`` for room
        before an allocation the driver found no room for fails, over its own grow channel
        (:meth:`.pause.vmm.VMM.set_grow_channel`; the allocation is made again once room
        was made); None: no longer. Returns whether this process has the allocator to ask
        (started with it, LD_PRELOAD).

        Raises:
            ValueError: ``socket_path`` is too long for a Unix socket.
        """
        allocator = self._allocator()
        if allocator is None:
            return False
        allocator.set_grow_channel(socket_path)
        return True

    def _torch_cuda(self):
        """The torch module once PyTorch has initialized CUDA (it has devices and cached
        figures to read), else None; no CUDA call."""
        torch = self._torch()
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch
        return None

    def _on_gpu(self) -> bool:
        """True once the kernel has a CUDA context: PyTorch initialized CUDA, or any library
        (CuPy, JAX) made the allocator's driver calls, or NVML lists the process."""
        if self._torch_cuda() is not None:
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
        if self._torch_cuda() is not None:
            return True
        allocator = self._allocator()
        return allocator is not None and allocator.backend == 1  # vmm.CUDA

    def pausable_bytes(self) -> int | None:
        """What a pause of the kernel as it is now would store at most, before compression
        (bytes): the pausable allocator's mapped pausable bytes (:meth:`.pause.vmm.VMM.figures`,
        ``own`` and ``others``) less PyTorch's free blocks on every device it initialized
        (:func:`.pause.torch_calls.unstored_bytes`: a pause stores live ranges only, and
        releases the rest unstored, free blocks beside live tensors included); a codec
        never stores more than the bytes it is given, but for its chunks' alignment. None
        where that is unknown: no pausable allocator on CUDA (a simulated card, the
        stand-in), or a figure that could not be read (logged). Needs no engine (one is
        made at the first pause or pin-ahead, after the state this figure goes with), and
        makes no CUDA call."""
        allocator = self._allocator()
        if allocator is None or allocator.backend != 1:  # vmm.CUDA
            return None
        from .pause.torch_calls import unstored_bytes  # no torch import of its own

        try:
            figures = allocator.figures()
            torch = self._torch_cuda()
            free = 0
            if torch is not None:  # else no device to count
                free = unstored_bytes(torch, range(torch.cuda.device_count()))
            return max(0, figures.own + figures.others - free)
        except Exception as e:  # a figure, never a failure of what sends it
            log.debug("jupyter-vgpu: what a pause would store is not known: %s", e)
            return None

    def cached_bytes(self) -> int | None:
        """The free blocks PyTorch's CUDA allocator keeps cached on every device the kernel
        initialized, bytes, less what shares a segment with a live tensor
        (:func:`.pause.torch_calls.cached_free_bytes`): what a release
        (:meth:`.pausing.PauseControl.release_cache`) gives back. None where PyTorch has not
        initialized CUDA (nothing cached), or the figure could not be read (logged). Makes
        no CUDA call."""
        torch = self._torch_cuda()
        if torch is None:
            return None
        from .pause.torch_calls import cached_free_bytes  # no torch import of its own

        try:
            return cached_free_bytes(torch, range(torch.cuda.device_count()))
        except Exception as e:  # a figure, never a failure of what sends it
            log.debug("jupyter-vgpu: the cached free bytes are not known: %s", e)
            return None

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
        cfg = self.config
        options = dict(
            use_nvcomp=cfg.use_nvcomp,
            scratch_bytes=cfg.scratch_bytes,
            host_cap_bytes=cfg.host_cap_bytes,
            spill_dir=cfg.spill_dir or None,
            local_memory=cfg.give_back_local_memory,
        )
        count = torch.cuda.device_count()
        if count > 1:  # a slice of several cards: memory may lie on any of them
            from .pause.devices import DevicesEngine

            self.engine = DevicesEngine(torch, allocator, list(range(count)), **options)
            return
        units = [s for s in allocator.segments() if s.mapped]
        device = units[0].device if units else torch.cuda.current_device()
        self.engine = PauseEngine(torch, allocator, device, **options)
        self.engine.sharing = self._sharing(torch, device)

    def _sharing(self, torch, device: int):
        """The engine's shared pieces (:mod:`.pause.sharing`) where its node arbiter may
        share them (its socket is known and ``share_pieces`` is on), else None. A kernel
        of several cards keeps its pieces its own (one holder's references are released
        together, and its engines pause and resume device by device)."""
        path = os.environ.get(SOCKET_ENV)
        if not (self.config.share_pieces and path):
            return None
        from jupyter_vgpu.host.pieces import socket_beside

        from .pause.piece_client import PieceClient
        from .pause.sharing import PieceSharing, Pinning

        return PieceSharing(lambda: PieceClient(socket_beside(path)), Pinning(torch, device))

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
        from .pause.torch_calls import plain_torch

        return plain_torch(torch)

    @property
    def stand_in(self) -> bool:
        """True on a simulated GPU, or with a PyTorch built without CUDA: pauses move no
        memory."""
        torch = self._torch()
        return bool(self._simulated() or (torch is not None and not torch.cuda.is_available()))


def _torch_module():
    import torch

    return torch
