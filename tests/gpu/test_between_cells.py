"""Code that runs between cells, on the GPU: a paused or suspended kernel never faults, never
freezes, and comes back on its first GPU call.

Each pattern of :mod:`jupyter_vgpu.testing.liveness` (an asyncio task, a tornado
``PeriodicCallback`` and ``call_later``, a ``threading.Timer``, a thread, a thread in a
CUDA call, a thread holding the GIL in a C call) keeps touching a CUDA tensor after its
cell, in a kernel that is paused (chaos ``pause``) or suspended through the driver's
checkpoint (chaos ``suspend``) after every cell: every step runs, the kernel's data come
back bit-exact, and a cell sent while the kernel is away is answered. Then the same
through the node arbiter (room on demand takes the kernel off while its task runs), a
widget-like comm callback while suspended, and an interrupt, a restart and a shutdown of a
suspended kernel."""

import json
import time

import pytest

from jupyter_vgpu import nvml
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing import card_holder, liveness
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.kernel_runner import Kernel
from jupyter_vgpu.testing.preloaded import environment
from jupyter_vgpu.testing.waiting import wait_for

pytestmark = pytest.mark.gpu
GiB = 2**30


@pytest.mark.parametrize("mode", ["pause", "suspend"])
@pytest.mark.parametrize("pattern", list(liveness.PATTERNS))
def test_code_between_cells_brings_the_kernel_back(tmp_path, pattern, mode):
    row = liveness.run_pattern(tmp_path, pattern, mode)
    assert row.left in ("paused", "suspended"), row  # nothing between cells keeps it on the card
    assert row.steps == 20, row
    assert row.exact, row


def report(channel, kernel) -> dict:
    try:
        return json.loads((channel / f"kernel-{kernel.id}.json").read_text()).get("pause") or {}
    except (OSError, ValueError):
        return {}


def suspended_kernel(tmp_path):
    channel = tmp_path / "channel"
    channel.mkdir()
    env = environment(JUPYTER_VGPU_CHAOS="suspend", JUPYTER_VGPU_CHANNEL=str(channel))
    kernel = Kernel(tmp_path, env, load_extension=True, log=tmp_path / "kernel.log")
    kernel.run(liveness.SETUP.replace("LOG", repr(str(tmp_path / "steps"))))
    wait_for(lambda: report(channel, kernel).get("state") == "suspended", 60, "the kernel suspended")
    return kernel, channel


def test_a_comm_message_to_a_suspended_kernel_runs_its_callback_on_the_gpu(tmp_path):
    """A widget's callback is a comm message: it restores the kernel first, then runs."""
    kernel, channel = suspended_kernel(tmp_path)
    try:
        kernel.run(
            "def opened(comm, msg):\n"
            "    @comm.on_msg\n"
            "    def _(msg):\n"
            "        acc.add_(msg['content']['data']['n'])\n"
            "        comm.send({'acc': acc.item()})\n"
            "get_ipython().kernel.comm_manager.register_target('adder', opened)"
        )
        wait_for(lambda: report(channel, kernel).get("state") == "suspended", 60, "suspended again")
        client = kernel.client
        comm_id = "c0"
        client.session.send(client.shell_channel.socket, "comm_open",
                            {"comm_id": comm_id, "target_name": "adder", "data": {}})  # fmt: skip
        client.session.send(client.shell_channel.socket, "comm_msg", {"comm_id": comm_id, "data": {"n": 5}})

        def answered():
            while True:
                msg = client.get_iopub_msg(timeout=1)
                if msg["msg_type"] == "comm_msg":
                    return msg["content"]["data"]

        assert wait_for(answered, 60, "the callback's answer") == {"acc": 5.0}
        assert json.loads(kernel.run(liveness.CHECK).strip().splitlines()[-1])["exact"]
    finally:
        kernel.shutdown()


def test_interrupt_restart_and_shutdown_of_a_suspended_kernel(tmp_path):
    """An interrupt of a suspended kernel changes nothing; a restart gives a working kernel
    within 10 s, and a shutdown ends the process within 10 s, leaving nothing on the card."""
    kernel, channel = suspended_kernel(tmp_path)
    gpu = nvml.list_gpus()[0].uuid
    try:
        kernel.manager.interrupt_kernel()
        assert json.loads(kernel.run(liveness.CHECK).strip().splitlines()[-1])["exact"]
        wait_for(lambda: report(channel, kernel).get("state") == "suspended", 60, "suspended again")
        old = kernel.pid
        t0 = time.monotonic()
        kernel.manager.restart_kernel(now=False)
        kernel.client.wait_for_ready(timeout=60)
        restarted = time.monotonic() - t0
        assert kernel.pid != old
        assert restarted < 10, f"the restart took {restarted:.1f} s"
        assert old not in nvml.process_memory(gpu)
        assert kernel.run("print(1 + 1)").strip() == "2"
        kernel.run("import torch\nx = torch.ones(1 << 20, device='cuda')")
        wait_for(lambda: report(channel, kernel).get("state") == "suspended", 60, "the new kernel suspended")
        pid = kernel.pid
        t0 = time.monotonic()
        kernel.manager.shutdown_kernel(now=False)
        ended = time.monotonic() - t0
        assert ended < 10, f"the shutdown took {ended:.1f} s"
        assert pid not in nvml.process_memory(gpu)
    finally:
        if kernel.manager.is_alive():
            kernel.shutdown()


def test_room_on_demand_takes_a_kernel_with_a_running_task_off_and_its_task_brings_it_back(tmp_path):
    """Through the node arbiter: ada's kernel runs an asyncio task touching her tensors
    between cells; bob's cell needs the card (ballast outside every server leaves the two
    kernels 12 GiB of it), so ada's kernel is taken off while her task runs. Her task's
    next GPU call brings her back once bob's cell is done; every step runs, her data are
    bit-exact, and bob's cell had its room."""
    gpu = nvml.list_gpus()[0]
    free = nvml.free_memory(gpu.uuid)
    ballast = card_holder.hold(free - 12 * GiB)
    slice_ = Slice.on_card(gpu, 10 * GiB, 100, overcommit_ratio=2.0)
    arbiter = ArbiterProcess(tmp_path, "--queue-timeout=300").start()
    kernels = {}
    try:
        for user in ("ada", "bob"):
            env = environment(JUPYTER_VGPU_ARBITER=str(arbiter.socket))
            kernels[user] = Kernel(tmp_path, env, load_extension=True, log=tmp_path / f"{user}.log")
            with arbiter.control() as c:
                c.register(kernels[user].pid, user, "", slice_)
        ada, bob = kernels["ada"], kernels["bob"]
        steps = tmp_path / "steps"
        ada.run(f"LOG = {str(steps)!r}\n" + liveness.SETUP + "big = torch.ones(5 * 2**28, device='cuda')")
        ada.run(
            "import asyncio\nasync def job():\n    for _ in range(100):\n"
            "        step(); await asyncio.sleep(0.05)\ntask = asyncio.ensure_future(job())"
        )
        out = bob.run(
            "import torch\nmine = torch.ones(8 * 2**28, device='cuda')\n"
            "import time; time.sleep(3)\nprint(mine.min().item(), mine.max().item())"
        )
        assert out.strip().splitlines()[-1] == "1.0 1.0", out
        wait_for(lambda: steps.read_text().count("\n") >= 100, 240, "ada's task to finish")
        got = json.loads(ada.run(liveness.CHECK + "\nprint(big.sum().item())").strip().splitlines()[0])
        assert got == {"acc": 100.0, "exact": True}
        taken = [d for d in arbiter.books()["decisions"] if d["what"] in ("pause", "suspend")]
        assert any(d["server"] == "ada/" for d in taken), taken
    finally:
        for kernel in kernels.values():
            kernel.shutdown()
        arbiter.stop()
        ballast.kill()
        ballast.wait()
