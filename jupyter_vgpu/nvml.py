"""NVML access: the only module of the project that imports pynvml (nvidia-ml-py).

Used by the Hub (GPU inventory) and by the single-user server (per-process sampling).
NVML is initialised once, lazily, on first use. Every function raises
:class:`NVMLUnavailable` when no NVIDIA driver is present, so callers can fall back to
simulated GPUs with one ``except``.
"""

from __future__ import annotations

import dataclasses
import threading

_lock = threading.Lock()
_initialised = False


class NVMLUnavailable(RuntimeError):
    """NVML (the NVIDIA driver's management library) cannot be used on this host."""


@dataclasses.dataclass(frozen=True)
class GPUInfo:
    """One GPU as NVML reports it.

    Attributes:
        index: NVML index on this host (0-based).
        uuid: ``GPU-…`` UUID, stable across reboots.
        name: product name, e.g. ``"NVIDIA H100 80GB HBM3"``.
        memory_total: total memory, bytes.
        memory_used: memory in use by all processes, bytes.
    """

    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int


def _nvml():
    """The initialised pynvml module.

    Raises:
        NVMLUnavailable: pynvml is missing or nvmlInit failed (no driver).
    """
    global _initialised
    try:
        import pynvml
    except ImportError as e:  # pragma: no cover - nvidia-ml-py is a dependency
        raise NVMLUnavailable(f"nvidia-ml-py is not installed: {e}") from None
    with _lock:
        if not _initialised:
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as e:
                raise NVMLUnavailable(f"NVML could not start (no NVIDIA driver?): {e}") from None
            _initialised = True
    return pynvml


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def list_gpus() -> list[GPUInfo]:
    """Every GPU on this host, in NVML index order.

    Raises:
        NVMLUnavailable: no NVIDIA driver.
    """
    nv = _nvml()
    gpus = []
    try:
        for index in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            memory = nv.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                GPUInfo(
                    index=index,
                    uuid=_text(nv.nvmlDeviceGetUUID(handle)),
                    name=_text(nv.nvmlDeviceGetName(handle)),
                    memory_total=int(memory.total),
                    memory_used=int(memory.used),
                )
            )
    except nv.NVMLError as e:
        raise NVMLUnavailable(f"NVML query failed: {e}") from None
    return gpus


def _handle(nv, gpu_uuid: str):
    try:
        return nv.nvmlDeviceGetHandleByUUID(gpu_uuid)
    except nv.NVMLError as e:
        raise NVMLUnavailable(f"no GPU with UUID {gpu_uuid}: {e}") from None


def process_memory(gpu_uuid: str) -> dict[int, int]:
    """GPU memory used by each process on one GPU, bytes, keyed by host PID.

    Compute and graphics processes are both counted. NVML reports no figure for a
    process in some containers; such processes are left out.

    Raises:
        NVMLUnavailable: no NVIDIA driver, or no GPU with this UUID.
    """
    nv = _nvml()
    handle = _handle(nv, gpu_uuid)
    used: dict[int, int] = {}
    for query in (nv.nvmlDeviceGetComputeRunningProcesses, nv.nvmlDeviceGetGraphicsRunningProcesses):
        try:
            processes = query(handle)
        except nv.NVMLError:
            continue
        for p in processes:
            if p.usedGpuMemory is not None:
                used[int(p.pid)] = used.get(int(p.pid), 0) + int(p.usedGpuMemory)
    return used


def device_usage(gpu_uuid: str) -> tuple[int, int, float | None]:
    """``(memory_used bytes, memory_total bytes, SM utilisation percent or None)`` of one GPU.

    Raises:
        NVMLUnavailable: no NVIDIA driver, or no GPU with this UUID.
    """
    nv = _nvml()
    handle = _handle(nv, gpu_uuid)
    memory = nv.nvmlDeviceGetMemoryInfo(handle)
    try:
        sm = float(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
    except nv.NVMLError:
        sm = None
    return int(memory.used), int(memory.total), sm


def process_utilization(gpu_uuid: str) -> dict[int, float]:
    """SM utilisation of each process on one GPU over NVML's last sample window, percent.

    Returns an empty dict where the driver gives no per-process figures.

    Raises:
        NVMLUnavailable: no NVIDIA driver, or no GPU with this UUID.
    """
    nv = _nvml()
    handle = _handle(nv, gpu_uuid)
    try:
        samples = nv.nvmlDeviceGetProcessUtilization(handle, 0)
    except nv.NVMLError:
        return {}
    result: dict[int, float] = {}
    for s in samples:
        result[int(s.pid)] = max(result.get(int(s.pid), 0.0), float(s.smUtil))
    return result
