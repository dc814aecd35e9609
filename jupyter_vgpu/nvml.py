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
import os
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
        mig_enabled: the GPU is in MIG mode: CUDA sees only its MIG instances
            (:func:`mig_devices`), not the whole card.
    """

    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int | None = None
    mig_enabled: bool = False


@dataclasses.dataclass(frozen=True)
class MIGInfo:
    """One MIG instance (a GPU instance with its compute instance) as NVML reports it.

    Attributes:
        parent_index: NVML index of the GPU it is carved from.
        parent_uuid: ``GPU-…`` UUID of that GPU.
        uuid: ``MIG-…`` UUID, what ``CUDA_VISIBLE_DEVICES`` takes.
        name: device name, e.g. ``"NVIDIA H100 80GB HBM3 MIG 3g.40gb"``.
        profile: the MIG profile, e.g. ``"3g.40gb"``.
        memory_total: the instance's memory, bytes.
        compute_percent: its share of the GPU's streaming multiprocessors, percent
            (1-100), or None when NVML does not say.
    """

    parent_index: int
    parent_uuid: str
    uuid: str
    name: str
    profile: str
    memory_total: int
    compute_percent: int | None


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


def driver_version() -> str:
    """The NVIDIA driver's version (``580.159.04``).

    Raises:
        NVMLUnavailable: no NVIDIA driver.
    """
    nv = _nvml()
    try:
        return _text(nv.nvmlSystemGetDriverVersion())
    except nv.NVMLError as e:
        raise NVMLUnavailable(f"NVML query failed: {e}") from None


#: Environment variable naming cards whose NVML queries fail as a card's do when it has
#: fallen off the bus: NVML indexes or UUIDs, comma-separated. For testing what one failing
#: card does to the others on a real host; read by the process that queries (the Hub's
#: inventory, the node arbiter), whose environment only its admin sets.
FAIL_ENV = "JUPYTER_VGPU_NVML_FAIL"


def injected_failure(uuid: str, index: int | None = None) -> str | None:
    """Why card ``uuid`` (NVML ``index``) is to fail its NVML queries (:data:`FAIL_ENV`
    names it), or None. Also asked for simulated cards, which have no NVML behind them."""
    named = {n.strip() for n in os.environ.get(FAIL_ENV, "").split(",") if n.strip()}
    if uuid in named or (index is not None and str(index) in named):
        return f"the card does not answer NVML ({FAIL_ENV} names it)"
    return None


def survey() -> tuple[list[GPUInfo], dict[int, str]]:
    """``(gpus, failing)``: every GPU on this host that answers NVML, in index order, and
    why each one that does not fails, by NVML index (a card that fell off the bus, or
    one :data:`FAIL_ENV` names). One failing card leaves the others listed.

    Raises:
        NVMLUnavailable: no NVIDIA driver, or NVML cannot count the GPUs.
    """
    nv = _nvml()
    try:
        count = nv.nvmlDeviceGetCount()
    except nv.NVMLError as e:
        raise NVMLUnavailable(f"NVML query failed: {e}") from None
    gpus, failing = [], {}
    for index in range(count):
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nv.nvmlDeviceGetUUID(handle))
            why = injected_failure(uuid, index)
            if why is not None:
                failing[index] = why
                continue
            memory = nv.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                GPUInfo(
                    index=index,
                    uuid=uuid,
                    name=_text(nv.nvmlDeviceGetName(handle)),
                    memory_total=int(memory.total),
                    memory_used=int(memory.used),
                    mig_enabled=_mig_enabled(nv, handle),
                )
            )
        except nv.NVMLError as e:
            failing[index] = f"NVML query failed: {e}"
    return gpus, failing


def list_gpus() -> list[GPUInfo]:
    """Every GPU on this host that answers NVML, in index order (:func:`survey` says why
    any other fails).

    Raises:
        NVMLUnavailable: no NVIDIA driver.
    """
    return survey()[0]


def _mig_enabled(nv, handle) -> bool:
    try:
        current, _pending = nv.nvmlDeviceGetMigMode(handle)
    except nv.NVMLError:  # not MIG-capable (NotSupported), or an older driver
        return False
    return current == nv.NVML_DEVICE_MIG_ENABLE


def mig_devices(gpu: str | int) -> list[MIGInfo]:
    """The MIG instances of one GPU, in NVML's order; empty when MIG mode is off.

    Args:
        gpu: the GPU's UUID (``GPU-…``) or NVML index.

    Raises:
        NVMLUnavailable: no NVIDIA driver, no such GPU, or NVML failed listing them.
    """
    nv = _nvml()
    handle = _handle(nv, gpu)
    if not _mig_enabled(nv, handle):
        return []
    try:
        parent_index = int(nv.nvmlDeviceGetIndex(handle))
        parent_uuid = _text(nv.nvmlDeviceGetUUID(handle))
        count = int(nv.nvmlDeviceGetMaxMigDeviceCount(handle))
    except nv.NVMLError as e:
        raise NVMLUnavailable(f"NVML query failed: {e}") from None
    total_sms = _full_gpu_sms(nv, handle)
    found = []
    for i in range(count):
        try:
            mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
        except nv.NVMLError:  # an empty slot (NVML_ERROR_NOT_FOUND)
            continue
        try:
            name = _text(nv.nvmlDeviceGetName(mig))
            memory = int(nv.nvmlDeviceGetMemoryInfo(mig).total)
            uuid = _text(nv.nvmlDeviceGetUUID(mig))
        except nv.NVMLError as e:
            raise NVMLUnavailable(f"NVML query of MIG device {i} on GPU {gpu!r} failed: {e}") from None
        try:
            attributes = nv.nvmlDeviceGetAttributes(mig)
        except nv.NVMLError:
            attributes = None
        profile = name.rpartition(" MIG ")[2].strip() if " MIG " in name else None
        if not profile and attributes is not None:
            profile = f"{attributes.gpuInstanceSliceCount}g.{round(attributes.memorySizeMB / 1000)}gb"
        percent = None
        if attributes is not None and total_sms:
            percent = max(1, min(100, round(100 * attributes.multiprocessorCount / total_sms)))
        found.append(MIGInfo(parent_index, parent_uuid, uuid, name, profile or "unknown", memory, percent))
    return found


def _full_gpu_sms(nv, handle) -> int | None:
    """SMs of the whole GPU in MIG mode: those of its largest GPU-instance profile."""
    for profile in ("NVML_GPU_INSTANCE_PROFILE_8_SLICE", "NVML_GPU_INSTANCE_PROFILE_7_SLICE"):
        try:
            info = nv.nvmlDeviceGetGpuInstanceProfileInfo(handle, getattr(nv, profile))
            return int(info.multiprocessorCount)
        except (nv.NVMLError, AttributeError):
            continue
    return None


def _handle(nv, gpu: str | int):
    try:
        if isinstance(gpu, int):
            handle = nv.nvmlDeviceGetHandleByIndex(gpu)
        else:
            handle = nv.nvmlDeviceGetHandleByUUID(gpu)
        if os.environ.get(FAIL_ENV):
            why = injected_failure(_text(nv.nvmlDeviceGetUUID(handle)), _index(nv, handle))
            if why is not None:
                raise NVMLUnavailable(f"GPU {gpu!r}: {why}")
        return handle
    except nv.NVMLError as e:
        raise NVMLUnavailable(f"no GPU {gpu!r}: {e}") from None


def _index(nv, handle) -> int | None:
    """The NVML index of a GPU's handle; a MIG instance's is its parent's."""
    try:
        return int(nv.nvmlDeviceGetIndex(handle))
    except nv.NVMLError:
        try:
            return int(nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)))
        except nv.NVMLError:
            return None


def process_memory(gpu: str | int) -> dict[int, int]:
    """GPU memory used by each process on one GPU, bytes, keyed by host PID.

    Args:
        gpu: the GPU's UUID (``GPU-…``/``MIG-…``) or NVML index.

    Compute, graphics and MPS clients' processes are all counted: a client of an MPS
    daemon (the ``mps`` backend's kernels) is listed by
    ``nvmlDeviceGetMPSComputeRunningProcesses`` alone, the daemon's server by the compute
    list. NVML gives each list's ``usedGpuMemory`` as all the memory the process uses
    (NVML API reference, ``nvmlDeviceGetComputeRunningProcesses_v3``), so a process in
    two lists counts once, at the larger figure. NVML reports no figure for a process in
    some containers; such processes are left out.

    Raises:
        NVMLUnavailable: no NVIDIA driver, or no such GPU.
    """
    nv = _nvml()
    handle = _handle(nv, gpu)
    used: dict[int, int] = {}
    queries = (
        nv.nvmlDeviceGetComputeRunningProcesses,
        nv.nvmlDeviceGetGraphicsRunningProcesses,
        nv.nvmlDeviceGetMPSComputeRunningProcesses,
    )
    for query in queries:
        try:
            processes = query(handle)
        except nv.NVMLError:
            continue
        for p in processes:
            if p.usedGpuMemory is not None:
                used[int(p.pid)] = max(used.get(int(p.pid), 0), int(p.usedGpuMemory))
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


def _process_sm(nv, handle) -> dict[int, float]:
    try:
        samples = nv.nvmlDeviceGetProcessUtilization(handle, 0)
    except nv.NVMLError:
        return {}
    result: dict[int, float] = {}
    for s in samples:
        result[int(s.pid)] = max(result.get(int(s.pid), 0.0), float(s.smUtil))
    return result


def footprint(pids: list[int]) -> dict[str, int]:
    """GPU memory the processes ``pids`` hold together, bytes per GPU UUID (GPUs where
    they hold nothing left out): what a driver's checkpoint of them takes off each card,
    and needs back to restore them.

    Raises:
        NVMLUnavailable: no NVIDIA driver.
    """
    wanted = set(pids)
    out: dict[str, int] = {}
    for gpu in list_gpus():
        held = sum(n for pid, n in process_memory(gpu.uuid).items() if pid in wanted)
        if held:
            out[gpu.uuid] = held
    return out


def free_memory(gpu: str | int) -> int:
    """Free memory of one GPU, bytes (total less used, NVML's ``nvmlDeviceGetMemoryInfo``).

    Raises:
        NVMLUnavailable: no NVIDIA driver, or no such GPU.
    """
    used, total, _ = device_usage(gpu)
    return max(0, total - used)
