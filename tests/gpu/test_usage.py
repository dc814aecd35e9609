"""Live usage on a real GPU: NVML's figure for a kernel holding 1 GiB reaches the
server's /api/vgpu/usage (sampled every 0.5 s; how soon is a benchmark's to measure)."""

import time

import pytest

from jupyter_vgpu import nvml
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.lab_client import LabClient
from jupyter_vgpu.testing.server_process import JupyterServer
from jupyter_vgpu.testing.waiting import wait_for

pytestmark = pytest.mark.gpu
GiB = 2**30


def test_nvml_usage_of_a_kernel_holding_1_gib_appears_in_the_servers_usage(tmp_path):
    gpu = nvml.list_gpus()[0]
    slice_ = Slice.on_card(gpu, 8 * GiB, 100)
    server = JupyterServer(
        tmp_path,
        {"JUPYTER_VGPU_SLICE": slice_.to_json(), "CUDA_VISIBLE_DEVICES": gpu.uuid},
        args=["--VGPUServer.sample_seconds=0.5"],
        vgpu=True,
    )
    try:
        lab = LabClient(server.url + "/", server.token)
        kid = lab.start_kernel()
        lab.execute(kid, "import torch\nx = torch.ones(GiB := 2**30, dtype=torch.uint8, device='cuda')")
        start = time.monotonic()

        def seen() -> tuple[dict, dict] | None:
            doc = server.get("api/vgpu/usage").json()
            kernel = next((k for k in doc["kernels"] if k["id"] == kid), None)
            return (doc, kernel) if kernel and (kernel["nvml_memory"] or 0) >= GiB else None

        doc, kernel = wait_for(
            seen, 30, "NVML's figure of at least 1 GiB in the server's usage", interval=0.1
        )
        print(f"NVML usage seen after {time.monotonic() - start:.2f} s: {kernel}")
        assert doc["simulated"] is False
        assert doc["gpu"]["memory_used"] >= GiB
        assert kernel["used"] == kernel["nvml_memory"]
    finally:
        server.stop()
