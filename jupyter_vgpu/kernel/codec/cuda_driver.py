"""The few CUDA driver calls the GPU codec path makes itself, through NVIDIA's cuda-bindings.

The codec's per-piece loop issues a handful of copies, event operations and graph
launches for every 8 MiB that crosses the bus; through PyTorch each costs tens of
microseconds of Python, which was measured to cap resume at about 20 GB/s on the H100.
The driver calls cost a microsecond or two.

A piece's stored chunks leave the compressor's output slots for the pinned slab in one
``cuMemcpyBatchAsync`` (CUDA 12.8 and later drivers): gathering them on the device first
took 270 µs of Python per 8 MiB piece (``torch.cat`` of 64 slices), more than the bus
needs to move the piece. The entry point is looked up through cuda-bindings'
``cuGetProcAddress`` and called through ``ctypes`` with the pointer arrays as numpy
buffers, one call per piece; drivers without it get one ``cuMemcpyAsync`` per chunk.
"""

from __future__ import annotations

import ctypes

import numpy as np

#: ``CU_MEMCPY_SRC_ACCESS_ORDER_STREAM``: the copies read their sources in stream order.
_STREAM_ORDER = 1
#: The ABI of ``cuMemcpyBatchAsync`` asked for: CUDA 12.8's (it has ``failIdx``).
_BATCH_ABI = 12080


class _Location(ctypes.Structure):
    """``CUmemLocation`` (cuda.h): the hints are ignored for device and pinned memory."""

    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class _CopyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (cuda.h, CUDA 12.8)."""

    _fields_ = (
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _Location),
        ("dstLocHint", _Location),
        ("flags", ctypes.c_uint),
    )


_BATCH = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p,  # CUdeviceptr *dsts
    ctypes.c_void_p,  # CUdeviceptr *srcs
    ctypes.c_void_p,  # size_t *sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # CUmemcpyAttributes *attrs
    ctypes.c_void_p,  # size_t *attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.c_void_p,  # size_t *failIdx
    ctypes.c_void_p,  # CUstream
)


class DriverUnavailable(RuntimeError):
    """``cuda-bindings`` is not installed (``jupyter-vgpu[gpu]`` brings it)."""


class Driver:
    """Asynchronous copies and events on raw streams.

    Raises:
        DriverUnavailable: cuda-bindings cannot be imported.
    """

    def __init__(self):
        try:
            from cuda.bindings import driver
        except ImportError as e:
            raise DriverUnavailable(f"cuda-bindings is not installed ({e})") from None
        self._cu = driver
        self._ok = driver.CUresult.CUDA_SUCCESS
        self._no_timing = driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._batch = None
        self._attrs = _CopyAttributes(_STREAM_ORDER)
        self._first = np.zeros(1, dtype=np.uint64)  # attrsIdxs: one set of attributes from copy 0 on
        self._fail = ctypes.c_size_t()
        try:
            default = driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
            result = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", _BATCH_ABI, default)
            if result[0] == self._ok and int(result[1]):
                self._batch = _BATCH(int(result[1]))
        except (AttributeError, TypeError, RuntimeError):
            pass  # an older cuda-bindings or driver: one copy per chunk
        #: why copies are not batched, or None when they are
        self.no_batch_reason = None if self._batch else "the driver has no cuMemcpyBatchAsync (CUDA < 12.8)"

    def _check(self, result, what: str):
        err = result[0]
        if err != self._ok:
            raise RuntimeError(f"{what} failed: {err}")
        return result[1] if len(result) > 1 else None

    def stream(self, handle: int):
        """The driver's handle for a ``torch.cuda.Stream`` (its ``cuda_stream``)."""
        return self._cu.CUstream(handle)

    def event(self):
        """A new event without timing."""
        return self._check(self._cu.cuEventCreate(self._no_timing), "cuEventCreate")

    def copy(self, dst: int, src: int, nbytes: int, stream) -> None:
        """Copy ``nbytes`` from address ``src`` to ``dst`` on ``stream`` (either side
        device or pinned host memory)."""
        if nbytes:
            self._check(self._cu.cuMemcpyAsync(dst, src, nbytes, stream), "cuMemcpyAsync")

    def copies(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream) -> None:
        """Enqueue ``len(sizes)`` copies on ``stream``, in one driver call where it can.

        Args:
            dsts, srcs: addresses (uint64 numpy arrays, contiguous), device or pinned host.
            sizes: bytes of each copy (uint64 numpy array, contiguous).
        """
        count = len(sizes)
        if not count:
            return
        if self._batch is not None:
            status = self._batch(
                dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, count, ctypes.addressof(self._attrs),
                self._first.ctypes.data, 1, ctypes.addressof(self._fail), int(stream),
            )  # fmt: skip
            if status == 0:
                return
            self._batch = None  # refused once: never again in this process; copy one by one
            self.no_batch_reason = f"cuMemcpyBatchAsync returned {status}"
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
            self.copy(dst, src, size, stream)

    def device_pointer(self, host: int) -> int:
        """The device's address of pinned host memory at ``host`` (the same number where
        the driver maps pinned memory at its host address, as on every 64-bit system)."""
        return int(self._check(self._cu.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer"))

    def record(self, event, stream) -> None:
        self._check(self._cu.cuEventRecord(event, stream), "cuEventRecord")

    def wait(self, stream, event) -> None:
        """Make ``stream`` wait for ``event`` (on the device, the host goes on)."""
        self._check(self._cu.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")

    def synchronize(self, event) -> None:
        """Block the host until ``event`` has happened."""
        self._check(self._cu.cuEventSynchronize(event), "cuEventSynchronize")

    def destroy(self, event) -> None:
        self._check(self._cu.cuEventDestroy(event), "cuEventDestroy")

    # -- CUDA graphs: a slot's per-piece work, captured once and launched per piece ------

    def capture(self, stream, enqueue) -> object:
        """Capture what ``enqueue()`` puts on ``stream`` into an executable graph.

        The capture is thread-local (``CU_STREAM_CAPTURE_MODE_THREAD_LOCAL``): other
        threads' CUDA calls neither break it nor are refused. Nothing runs on the device.

        Raises:
            RuntimeError: the driver refused the capture or its instantiation (an
                operation in ``enqueue`` that cannot be captured), or ``enqueue`` raised;
                the stream is out of capture mode again either way.
        """
        cu = self._cu
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        self._check(cu.cuStreamBeginCapture(stream, mode), "cuStreamBeginCapture")
        try:
            enqueue()
        except BaseException:
            result = cu.cuStreamEndCapture(stream)
            if result[0] == self._ok:
                cu.cuGraphDestroy(result[1])
            raise
        graph = self._check(cu.cuStreamEndCapture(stream), "cuStreamEndCapture")
        try:
            return self._check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        finally:
            cu.cuGraphDestroy(graph)

    def launch(self, graph, stream) -> None:
        """Enqueue an executable graph from :meth:`capture` on ``stream``."""
        self._check(self._cu.cuGraphLaunch(graph, stream), "cuGraphLaunch")

    def destroy_graph(self, graph) -> None:
        self._check(self._cu.cuGraphExecDestroy(graph), "cuGraphExecDestroy")
