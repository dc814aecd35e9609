"""A kernel under a node arbiter that stays idle after a cell pins ahead the host memory
its next pause stores into (``VGPUKernel.prepare_pinned``): its first pause then takes
those slabs instead of pinning on the way (and lets go of those it did not fill), its
data comes back bit-exact, and the arbiter's books count the slabs."""

import json

import pytest

from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.fault_kernels import gpu_kernel
from jupyter_vgpu.testing.waiting import wait_for

pytestmark = pytest.mark.gpu

GiB = 1 << 30


def pause_figures(report) -> dict:
    try:
        return json.loads(report.read_text())["pause"]
    except (OSError, ValueError, KeyError):
        return {}


def test_an_idle_kernel_pins_ahead_and_its_first_pause_pins_nothing_more(tmp_path):
    channel = tmp_path / "channel"
    channel.mkdir()
    arbiter = ArbiterProcess(tmp_path).start()  # only a kernel under an arbiter pins ahead
    kernel = gpu_kernel(
        tmp_path,
        arbiter,
        "ada",
        8 * GiB,
        env={"JUPYTER_VGPU_CHANNEL": str(channel)},
        args=("--VGPUKernel.prepare_after=0.5",),
    )
    report = channel / f"kernel-{kernel.id}.json"
    try:
        kernel.run(
            "import torch\n"
            "g = torch.Generator(device='cuda').manual_seed(0)\n"
            "x = (torch.randn(GiB := 1 << 29, device='cuda', generator=g) * 0.02).to(torch.bfloat16)\n"
            "before = x.view(torch.int16).cpu()"
        )
        wait_for(
            lambda: pause_figures(report).get("pinned_bytes", 0) >= GiB,
            what="the idle kernel's report to show 1 GiB of host memory pinned ahead",
        )
        held = pause_figures(report)["pinned_bytes"]
        assert pause_figures(report)["state"] == "idle", "pinned ahead without a pause"
        kernel.run("%vgpu pause")
        wait_for(
            lambda: pause_figures(report).get("state") == "paused", what="the kernel paused by %vgpu pause"
        )
        figures = pause_figures(report)
        # no more on the way (once paused, the slabs its data does not fill are let go:
        # VGPUKernel.trim_when_paused)
        assert figures["pinned_bytes"] <= held, "the first pause pinned more on the way"
        trim = wait_for(
            lambda: pause_figures(report).get("last_trim"), what="the paused kernel's trim in its report"
        )
        print("trim once paused:", json.dumps(trim), "private now:", pause_figures(report)["private_bytes"])
        assert trim["private_after"] is not None
        assert trim["private_after"] <= trim["private_before"] + GiB // 8
        assert figures["live_bytes"] >= GiB
        assert kernel.run("print(torch.equal(before, x.view(torch.int16).cpu()))").strip() == "True"
        # the books count the slabs it still holds (those its paused data fills)
        still = pause_figures(report)["pinned_bytes"]
        assert still >= figures["host_bytes"] > 0, pause_figures(report)
        wait_for(
            lambda: arbiter.kernel(kernel.pid)["host_bytes"] >= still,
            what=f"the arbiter's books to count the {still} bytes of slabs the paused kernel holds",
        )
    finally:
        kernel.shutdown()
        arbiter.stop()


def test_a_kernel_says_what_its_pause_would_store_its_cached_blocks_left_out(tmp_path):
    """After a cell whose activations were freed, PyTorch keeps their blocks cached: the
    card holds them, a pause stores none of them. The kernel says what its pause would
    store (``pausable_bytes``, protocol version 3), and the arbiter's books hold it beside
    the resident bytes NVML reads, for its estimate of the pause's host memory
    (:func:`jupyter_vgpu.node.tiers.host_need`)."""
    arbiter = ArbiterProcess(tmp_path).start()
    kernel = gpu_kernel(tmp_path, arbiter, "ada", 8 * GiB, args=("--VGPUKernel.prepare_pinned=False",))
    try:
        kernel.run(
            "import torch\n"
            "x = torch.ones(1 << 30, dtype=torch.uint8, device='cuda')\n"  # 1 GiB live
            "t = torch.empty(6 << 30, dtype=torch.uint8, device='cuda')\n"
            "del t\n"  # 6 GiB freed, cached
        )

        def entry() -> dict:
            return arbiter.kernel(kernel.pid) or {}

        wait_for(
            lambda: entry().get("resident", 0) >= 7 * GiB and entry().get("pausable_bytes") is not None,
            60,
            "the books to hold the kernel's 7 GiB on the card and what its pause would store",
        )
        said = entry()["pausable_bytes"]
        print("resident", entry()["resident"], "pausable", said)
        assert GiB <= said < 1.25 * GiB, entry()
    finally:
        kernel.shutdown()
        arbiter.stop()
