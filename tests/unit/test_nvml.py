"""NVML access: a clear error without a driver, real figures with one."""

import threading

import pytest

from jupyter_vgpu import nvml

HAS_NVML = nvml.available()


@pytest.mark.skipif(HAS_NVML, reason="this host has an NVIDIA driver")
def test_every_call_raises_nvml_unavailable_without_a_driver():
    calls = [
        nvml.list_gpus,
        lambda: nvml.process_memory(0),
        lambda: nvml.process_memory("GPU-00000000-0000-0000-0000-000000000000"),
        lambda: nvml.utilization(0),
        lambda: nvml.device_usage(0),
        lambda: nvml.mig_devices(0),
    ]
    for call in calls:
        with pytest.raises(nvml.NVMLUnavailable, match="NVML"):
            call()


@pytest.mark.skipif(HAS_NVML, reason="this host has an NVIDIA driver")
def test_concurrent_first_use_fails_the_same_way_in_every_thread():
    nvml._state.clear()  # forget the remembered failure: the threads race to initialise
    errors: list[str] = []

    def probe():
        try:
            nvml.list_gpus()
        except nvml.NVMLUnavailable as e:
            errors.append(str(e))

    threads = [threading.Thread(target=probe) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 8
    assert len(set(errors)) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_NVML, reason="needs an NVIDIA driver")
def test_real_gpus_by_index_and_uuid():
    gpus = nvml.list_gpus()
    assert gpus
    assert [g.index for g in gpus] == list(range(len(gpus)))
    g = gpus[0]
    assert g.memory_total > 0
    assert 0 <= g.memory_used <= g.memory_total
    used, total, sm = nvml.device_usage(g.uuid)
    assert 0 < used <= total
    assert total == g.memory_total
    assert sm is None or 0 <= sm <= 100
    assert set(nvml.process_memory(g.uuid)) == set(nvml.process_memory(g.index))
    u = nvml.utilization(g.index)
    assert u.device is None or 0 <= u.device <= 100
    assert all(0 <= v <= 100 for v in u.processes.values())
    with pytest.raises(nvml.NVMLUnavailable, match="no GPU"):
        nvml.process_memory("GPU-00000000-0000-0000-0000-000000000000")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_NVML, reason="needs an NVIDIA driver")
def test_mig_instances_are_listed_only_in_mig_mode():
    for g in nvml.list_gpus():
        instances = nvml.mig_devices(g.index)
        print(g.index, g.name, "MIG mode" if g.mig_enabled else "no MIG", instances)
        if not g.mig_enabled:
            assert instances == []
        for m in instances:
            assert m.uuid.startswith("MIG-")
            assert m.parent_uuid == g.uuid
            assert 0 < m.memory_total < g.memory_total
            assert m.profile[0].isdigit()
            assert m.compute_percent is None or 1 <= m.compute_percent <= 100


class _TwoCards:
    """Stands in for pynvml's module on a host of two cards whose second fell off the
    bus (its queries fail with NVML's error, as the driver's do then): what the survey
    does with a failing card, on a machine without cards. On a real host,
    tests/gpu/test_two_gpus.py fails a card through JUPYTER_VGPU_NVML_FAIL instead."""

    class NVMLError(Exception):
        pass

    NVML_DEVICE_MIG_ENABLE = 1

    class _Memory:
        total, used = 80 * 2**30, 2**30

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetUUID(self, handle):
        return f"GPU-{handle}"

    def nvmlDeviceGetName(self, handle):
        return "H100"

    def nvmlDeviceGetMemoryInfo(self, handle):
        if handle == 1:
            raise self.NVMLError("GPU is lost")
        return self._Memory()

    def nvmlDeviceGetMigMode(self, handle):
        raise self.NVMLError("Not Supported")


def test_one_failing_card_leaves_the_others_listed_and_says_why(monkeypatch):
    monkeypatch.setitem(nvml._state, "pynvml", _TwoCards())
    gpus, failing = nvml.survey()
    assert [g.uuid for g in gpus] == ["GPU-0"]
    assert failing == {1: "NVML query failed: GPU is lost"}
    assert [g.uuid for g in nvml.list_gpus()] == ["GPU-0"]
    monkeypatch.setenv(nvml.FAIL_ENV, "GPU-0")  # and one named as failing
    gpus, failing = nvml.survey()
    assert gpus == []
    assert set(failing) == {0, 1}
    assert "JUPYTER_VGPU_NVML_FAIL" in failing[0]


class _MPSCard:
    """Stands in for pynvml's module on one card with an MPS daemon: NVML lists the
    daemon's server among compute processes and its clients only among MPS compute
    processes; a process with compute and graphics contexts is in both of those lists,
    each figure all of its memory. tests/gpu/test_mps.py checks a real client is listed."""

    class NVMLError(Exception):
        pass

    class _Process:
        def __init__(self, pid, used):
            self.pid, self.usedGpuMemory = pid, used

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [self._Process(100, 600 << 20), self._Process(300, 3 << 30)]  # the MPS server; a viewer

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle):
        return [self._Process(300, 3 << 30), self._Process(400, None)]  # the viewer again; no figure

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle):
        return [self._Process(200, 2 << 30)]  # a kernel, a client of the daemon


def test_mps_clients_are_counted_and_a_process_in_two_lists_once(monkeypatch):
    monkeypatch.setitem(nvml._state, "pynvml", _MPSCard())
    assert nvml.process_memory(0) == {100: 600 << 20, 200: 2 << 30, 300: 3 << 30}
