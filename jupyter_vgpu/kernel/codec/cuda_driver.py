"""The few CUDA driver calls the GPU codec path makes itself, through NVIDIA's cuda-bindings.

The codec's per-piece loop issues a handful of copies, event operations and graph
launches for every 8 MiB that crosses the bus; through PyTorch each costs tens of
microseconds of Python, which was measured to cap resume at about 20 GB/s on the H100.
The driver calls cost a microsecond or two.

A piece's stored chunks are gathered on the GPU (``codec.kernels``) and leave in one
``cuMemcpyAsync``: a batched copy of its chunks (``cuMemcpyBatchAsync``) cost 52 µs of
host time per 8 MiB piece on the H100 box, and gathering them through PyTorch
(``torch.cat`` of 64 slices) 270 µs.
"""

from __future__ import annotations


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

    def zero(self, dst: int, nbytes: int, stream) -> None:
        """Set ``nbytes`` of device memory at ``dst`` to zero on ``stream``."""
        if nbytes:
            self._check(self._cu.cuMemsetD8Async(dst, 0, nbytes, stream), "cuMemsetD8Async")

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
