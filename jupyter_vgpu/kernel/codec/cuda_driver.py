"""The few CUDA driver calls the GPU codec path makes itself, through NVIDIA's cuda-bindings.

The codec's per-piece loop issues a handful of copies and event operations for every
8 MiB that crosses the bus; through PyTorch each costs tens of microseconds of Python,
which was measured to cap resume at about 20 GB/s on the H100. The driver calls cost a
microsecond or two. Kernels still run through PyTorch (on the stream made current for
the loop).
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
