"""The local memory a paused kernel's CUDA context gives back beside its allocations.

The driver reserves local memory (the threads' stacks and spills) for every thread a card
can hold, context wide: the per-thread stack limit (``CU_LIMIT_STACK_SIZE``, 1 KiB at the
start) times the threads an SM holds times the SMs (NVIDIA's CUDA Driver API,
``cuCtxSetLimit``; "Local memory management", NVIDIA developer forums). A launch that
needs more grows it, and the driver keeps the most any kernel needed (the Driver API's
note on ``CU_CTX_LMEM_RESIZE_TO_MAX``: now the only behaviour). On an H100, 1 KiB
a thread is 132 x 2,048 x 1 KiB = 264 MiB of every context, paused or not; at 12x (48
MLP sessions) the contexts are 44% of the card (``benchmarks/results/sessions-h100.json``,
``context_bytes``: 0.73 GiB each).

:class:`LocalMemory` sets the limit to the smallest the driver takes once a pause has
given back every allocation, and sets it back to what it was before a resume maps
anything: the driver reallocates at once, so a card with no room for it refuses the
resume (:class:`~.vmm.DeviceFull`, still paused) instead of failing a launch in the
user's code later. What it gives back is counted in the engine's ``paused_bytes`` (what a
resume needs). ``benchmarks/context_parts.py`` measures both calls on a real card.

What a fall of the limit frees is also read from NVML (the process's own bytes on the
card, before and after), and the larger of that and ``limit x threads`` is counted: a
launch that needed more than the limit grew the context past ``limit x threads`` (the
note above), and a resume asks room for whatever the fall freed. On an H200 the two
agreed: after a sort and a matrix product the fall from 1 KiB to 0 freed 264 MiB by NVML,
as counted (a probe at a15fe60; docs/design.md, the seventeenth try). The 322 MiB a GPU
test once saw (``benchmarks/results/gpu-tests-h200x2.log``, f922f59) was measured beside
a plain pause whose process was 58 MiB larger for reasons of its own, not local memory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from .vmm import DeviceFull

log = logging.getLogger("jupyter_vgpu")

#: Stack limits asked for on a pause, in order, bytes: the first the driver takes is kept
#: (it may round up; :meth:`LocalMemory.give_back` reads back what it set).
SMALLEST = (0, 16)


class LocalMemoryError(RuntimeError):
    """A driver call about the stack limit failed other than for want of room; the
    message names the call and the driver's error."""


class LocalMemory:
    """The stack limit of ``device``'s primary context, given back and taken back.

    Args:
        device: CUDA ordinal (as the process numbers its cards).
        driver: the ``cuda.bindings.driver`` module (tests give a stand-in).
        held: this process's bytes on the card now, or None where unknown (default: NVML's
            figure for the card's UUID, :func:`jupyter_vgpu.nvml.process_memory`).

    Raises:
        LocalMemoryError: the driver could not say the card's SMs or threads per SM.
    """

    def __init__(self, device: int, driver=None, held: Callable[[], int | None] | None = None):
        if driver is None:
            from cuda.bindings import driver
        self._cu = driver
        self._held = held if held is not None else self._nvml_held
        self._uuid_name: str | None = None  # the card's, as NVML names it (:meth:`_uuid`)
        self.device = device
        err, self._dev = driver.cuDeviceGet(device)
        self._ok(err, "cuDeviceGet")
        attr = driver.CUdevice_attribute
        #: threads the card holds at once: SMs times threads per SM
        self.threads = self._attribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) * self._attribute(
            attr.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR
        )
        #: the stack limit before the pause, bytes a thread (None: nothing given back)
        self.kept: int | None = None
        #: what a resume needs back for it, bytes (0: nothing given back)
        self.owed = 0

    def _ok(self, err, what: str) -> None:
        if err != self._cu.CUresult.CUDA_SUCCESS:
            raise LocalMemoryError(f"{what} failed: {err}")

    def _attribute(self, which) -> int:
        err, value = self._cu.cuDeviceGetAttribute(which, self._dev)
        self._ok(err, "cuDeviceGetAttribute")
        return int(value)

    def _uuid(self) -> str:
        """The card's UUID as NVML names it (``GPU-…``), from the driver; read once (a
        card's UUID does not change).

        Raises:
            LocalMemoryError: the driver could not say it.
        """
        if self._uuid_name is None:
            cu = self._cu
            get = getattr(cu, "cuDeviceGetUuid_v2", None) or cu.cuDeviceGetUuid
            err, uuid = get(self._dev)
            self._ok(err, "cuDeviceGetUuid")
            raw = uuid.bytes  # char[16]: bytes, or a sequence of (signed) ints
            if isinstance(raw, str):
                raw = raw.encode("latin-1")
            h = (raw if isinstance(raw, bytes) else bytes(b & 0xFF for b in raw)).hex()
            self._uuid_name = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
        return self._uuid_name

    def _nvml_held(self) -> int | None:
        """This process's bytes on the card per NVML (the card by the driver's UUID), or
        None where NVML or the UUID cannot say (a figure, never a failure)."""
        try:
            from jupyter_vgpu import nvml

            return nvml.process_memory(self._uuid()).get(os.getpid())
        except Exception as e:
            log.debug("jupyter-vgpu: this process's bytes on device %d are not known: %s", self.device, e)
            return None

    def _in_context(self, call):
        """``call()`` with the device's primary context current in this thread; its
        result: the driver's ``(err, ...)`` tuple."""
        cu = self._cu
        err, ctx = cu.cuDevicePrimaryCtxRetain(self._dev)
        self._ok(err, "cuDevicePrimaryCtxRetain")
        try:
            (err,) = cu.cuCtxPushCurrent(ctx)
            self._ok(err, "cuCtxPushCurrent")
            try:
                return call()
            finally:
                cu.cuCtxPopCurrent()
        finally:
            cu.cuDevicePrimaryCtxRelease(self._dev)

    def _stack(self) -> int:
        err, value = self._in_context(lambda: self._cu.cuCtxGetLimit(self._cu.CUlimit.CU_LIMIT_STACK_SIZE))
        self._ok(err, "cuCtxGetLimit")
        return int(value)

    def _set(self, nbytes: int):
        stack = self._cu.CUlimit.CU_LIMIT_STACK_SIZE
        (err,) = self._in_context(lambda: self._cu.cuCtxSetLimit(stack, nbytes))
        return err

    def give_back(self) -> int:
        """Set the stack limit to the smallest the driver takes (:data:`SMALLEST`), the
        device idle and every allocation given back; returns the bytes given back: what
        the process's bytes on the card fell by (``held``, read before and after), and at
        least the limit's fall times :attr:`threads` (all of it where ``held`` cannot
        say); 0 where the driver took none of them or the limit was at its smallest
        already. Call it once a pause; :meth:`take_back` undoes it.

        Raises:
            LocalMemoryError: the driver could not say the limit.
        """
        if self.kept is not None:
            return self.owed
        was = self._stack()
        before = None
        for asked in SMALLEST:
            if asked >= was:
                break
            if before is None:
                before = self._held()
            err = self._set(asked)
            if err == self._cu.CUresult.CUDA_SUCCESS:
                now = self._stack()
                after = self._held()
                fell = before - after if before is not None and after is not None else 0
                self.kept, self.owed = was, max((was - now) * self.threads, fell, 0)
                return self.owed
            log.debug("jupyter-vgpu: the driver refused a stack limit of %d bytes: %s", asked, err)
        return 0

    def take_back(self) -> None:
        """Set the stack limit back to what it was before :meth:`give_back` (nothing to do
        where nothing was given back); the driver reallocates the local memory at once.

        Raises:
            DeviceFull: the card has no room for it: still given back, nothing changed.
            LocalMemoryError: any other refusal of the driver.
        """
        if self.kept is None:
            return
        err = self._set(self.kept)
        if err == self._cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            what = f"the CUDA context's local memory needs {self.owed} free bytes on device {self.device}"
            raise DeviceFull(int(err), what, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory")
        self._ok(err, "cuCtxSetLimit")
        self.kept, self.owed = None, 0
