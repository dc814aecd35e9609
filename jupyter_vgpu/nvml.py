"""NVML access: the only module of the project that imports pynvml (nvidia-ml-py).

Used by the Hub (GPU inventory) and by the single-user server (per-process sampling).
NVML is initialised once, lazily, on first use. Every function raises
:class:`NVMLUnavailable` when no NVIDIA driver is present, so callers can fall back to
simulated GPUs with one ``except``.

Thread-safe: initialisation (or its failure, remembered so that a host without a
driver fails fast) happens once under a lock, and NVML's own calls are thread-safe
(NVML API reference, "Multi-threaded usage"), so the server may sample from a thread
executor while the Hub lists GPUs.
"""

from __future__ import annotations

import dataclasses
import threading

_lock = threading.Lock()
#: ``"pynvml"``: the module once nvmlInit succeeded; ``"failure"``: why it did not.
_state: dict = {}


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
        memory_used: memory in use by all processes when listed, bytes, or None.
    """

    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int | None = None


@dataclasses.dataclass(frozen=True)
class Utilization:
    """SM utilisation of one GPU, percent (0-100), from NVML's last sample window.

    Attributes:
        device: the whole GPU's SM utilisation, or None when NVML gives none.
        processes: per host PID, where the driver gives per-process figures
            (``nvmlDeviceGetProcessUtilization``); empty otherwise.
    """

    device: float | None
    processes: dict[int, float]


def _nvml():
    """The initialised pynvml module.

    Raises:
        NVMLUnavailable: pynvml is missing or nvmlInit failed (no driver).
    """
    with _lock:
        if "pynvml" in _state:
            return _state["pynvml"]
        if "failure" in _state:  # a host without a driver does not get one later: fail fast
            raise NVMLUnavailable(_state["failure"])
        try:
            import pynvml
        except ImportError as e:  # pragma: no cover - nvidia-ml-py is a dependency
            _state["failure"] = f"nvidia-ml-py is not installed: {e}"
            raise NVMLUnavailable(_state["failure"]) from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            _state["failure"] = f"NVML could not start (no NVIDIA driver?): {e}"
            raise NVMLUnavailable(_state["failure"]) from None
        _state["pynvml"] = pynvml
        return pynvml


def available() -> bool:
    """True when NVML works on this host (at least one call can succeed)."""
    try:
        _nvml()
    except NVMLUnavailable:
        return False
    return True


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


def _handle(nv, gpu: str | int):
    try:
        if isinstance(gpu, int):
            return nv.nvmlDeviceGetHandleByIndex(gpu)
        return nv.nvmlDeviceGetHandleByUUID(gpu)
    except nv.NVMLError as e:
        raise NVMLUnavailable(f"no GPU {gpu!r}: {e}") from None


def process_memory(gpu: str | int) -> dict[int, int]:
    """GPU memory used by each process on one GPU, bytes, keyed by host PID.

    Args:
        gpu: the GPU's UUID (``GPU-…``/``MIG-…``) or NVML index.

    Compute and graphics processes are both counted. NVML reports no figure for a
    process in some containers; such processes are left out.

    Raises:
        NVMLUnavailable: no NVIDIA driver, or no such GPU.
    """
    nv = _nvml()
    handle = _handle(nv, gpu)
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


def device_usage(gpu: str | int) -> tuple[int, int, float | None]:
    """``(memory_used bytes, memory_total bytes, SM utilisation percent or None)`` of one GPU.

    Args:
        gpu: the GPU's UUID or NVML index.

    Raises:
        NVMLUnavailable: no NVIDIA driver, or no such GPU.
    """
    nv = _nvml()
    handle = _handle(nv, gpu)
    try:
        memory = nv.nvmlDeviceGetMemoryInfo(handle)
    except nv.NVMLError as e:
        raise NVMLUnavailable(f"NVML query failed: {e}") from None
    return int(memory.used), int(memory.total), _device_sm(nv, handle)


def _device_sm(nv, handle) -> float | None:
    try:
        return float(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
    except nv.NVMLError:
        return None


def utilization(gpu: str | int) -> Utilization:
    """SM utilisation of one GPU: per process where the driver gives it, and device-wide.

    Args:
        gpu: the GPU's UUID or NVML index.

    Raises:
        NVMLUnavailable: no NVIDIA driver, or no such GPU.
    """
    nv = _nvml()
    handle = _handle(nv, gpu)
    return Utilization(device=_device_sm(nv, handle), processes=_process_sm(nv, handle))


def process_utilization(gpu: str | int) -> dict[int, float]:
    """SM utilisation of each process on one GPU over NVML's last sample window, percent.

    Returns an empty dict where the driver gives no per-process figures.

    Raises:
        NVMLUnavailable: no NVIDIA driver, or no such GPU.
    """
    nv = _nvml()
    return _process_sm(nv, _handle(nv, gpu))


def _process_sm(nv, handle) -> dict[int, float]:
    try:
        samples = nv.nvmlDeviceGetProcessUtilization(handle, 0)
    except nv.NVMLError:
        return {}
    result: dict[int, float] = {}
    for s in samples:
        result[int(s.pid)] = max(result.get(int(s.pid), 0.0), float(s.smUtil))
    return result
