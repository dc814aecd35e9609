"""The budget on a real GPU: NVML inventory, OOM at the slice budget, live change."""

import pytest

from jupyter_vgpu import channel, nvml
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.kernel_runner import Kernel
from jupyter_vgpu.testing.waiting import wait_for

pytestmark = pytest.mark.gpu
GiB = 2**30


@pytest.fixture
def gpu_slice():
    gpu = nvml.list_gpus()[0]
    return Slice.on_card(gpu, 2 * GiB, 100, simulated=False)


def test_nvml_sees_the_real_card():
    gpus = nvml.list_gpus()
    assert gpus
    assert gpus[0].uuid.startswith(("GPU-", "MIG-"))
    assert gpus[0].memory_total > 8 * GiB
    print("NVML:", [(g.index, g.name, g.memory_total) for g in gpus])


def test_budget_oom_names_the_slice_and_a_live_change_moves_the_limit(tmp_path, gpu_slice):
    ch = tmp_path / "channel"
    channel.write_json(channel.server_path(ch), {"slice": gpu_slice.to_dict(), "pressure": False})
    env = {"JUPYTER_VGPU_CHANNEL": str(ch), "CUDA_VISIBLE_DEVICES": gpu_slice.gpu_uuid}
    k = Kernel(tmp_path, env, load_extension=True)

    def set_budget(limit: int, text: str, what: str) -> str:
        """A live change of the slice's budget, through the server's channel; the status
        once it shows ``text``."""
        changed = gpu_slice.replace(memory_limit=limit)
        channel.write_json(channel.server_path(ch), {"slice": changed.to_dict(), "pressure": False})

        def showing() -> str | None:
            status = k.run("%vgpu status")
            return status if text in status else None

        return wait_for(showing, 30, what)

    try:
        out = k.run("import torch\nx = torch.empty(3 * 2**30, dtype=torch.uint8, device='cuda')")
        print(out)
        assert "OutOfMemoryError" in out
        assert "vGPU slice budget: 2.00 GiB" in out
        assert k.run("print(torch.ones(4, device='cuda').sum().item())").strip() == "4.0"  # alive
        status = k.run("%vgpu status")
        print(status)
        assert "budget 2.00 GiB applied to PyTorch" in status

        set_budget(4 * GiB, "4.00 GiB applied", "the raised budget applied in %vgpu status")
        out = k.run("x = torch.empty(3 * 2**30, dtype=torch.uint8, device='cuda'); print(x.numel())")
        assert out.strip() == str(3 * 2**30), out

        # lowering below what the kernel holds is allowed and reported, not a crash
        set_budget(1 * GiB, "over the new budget", "the lowered budget reported in %vgpu status")
        assert k.run("print(x.numel())").strip() == str(3 * 2**30)  # alive, tensor still there
    finally:
        k.shutdown()


def _pids_are_host_pids(gpu_uuid: str) -> bool:
    """NVML reports host PIDs; in a container with its own PID namespace they do not
    name this namespace's processes. True when at least one listed PID is ours."""
    import os

    return any(os.path.exists(f"/proc/{pid}") for pid in nvml.process_memory(gpu_uuid))


def test_nvml_sees_the_kernel_process(tmp_path, gpu_slice):
    ch = tmp_path / "channel"
    channel.write_json(channel.server_path(ch), {"slice": gpu_slice.to_dict(), "pressure": False})
    env = {"JUPYTER_VGPU_CHANNEL": str(ch), "CUDA_VISIBLE_DEVICES": gpu_slice.gpu_uuid}
    k = Kernel(tmp_path, env, load_extension=True)
    try:
        k.run("import torch, os\nx = torch.empty(2**30, dtype=torch.uint8, device='cuda')")
        pid = int(k.run("print(os.getpid())"))
        listed = nvml.process_memory(gpu_slice.gpu_uuid)
        print("NVML processes:", listed, "kernel PID:", pid)
        if pid not in listed and not _pids_are_host_pids(gpu_slice.gpu_uuid):
            pytest.skip("NVML lists host PIDs, and this container has its own PID namespace")
        assert listed[pid] >= GiB
        assert "used (NVML)" in k.run("%vgpu status")
    finally:
        k.shutdown()
