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
"""

from __future__ import annotations

import logging

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

    Raises:
        LocalMemoryError: the driver could not say the card's SMs or threads per SM.
    """

    def __init__(self, device: int, driver=None):
        if driver is None:
            from cuda.bindings import driver
        self._cu = driver
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
        device idle and every allocation given back; returns the bytes given back (the
        limit's fall times :attr:`threads`; 0 where the driver took none of them or the
        limit was at its smallest already). Call it once a pause; :meth:`take_back` undoes it.

        Raises:
            LocalMemoryError: the driver could not say the limit.
        """
        if self.kept is not None:
            return self.owed
        was = self._stack()
        for asked in SMALLEST:
            if asked >= was:
                break
            err = self._set(asked)
            if err == self._cu.CUresult.CUDA_SUCCESS:
                now = self._stack()
                self.kept, self.owed = was, max(0, was - now) * self.threads
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
