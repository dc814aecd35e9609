"""Interrupting a kernel in chaos mode ``suspend`` while the driver holds it suspended: the
interrupt does not reach the checkpoint helper (a session of its own, SIGINT ignored),
nothing prints a traceback, and the next cell finds its data, as in a plain kernel."""

import json
import os

import psutil
import pytest

from jupyter_vgpu.testing.kernel_runner import Kernel
from jupyter_vgpu.testing.preloaded import environment
from jupyter_vgpu.testing.waiting import wait_for

pytestmark = pytest.mark.gpu


def pause_state(report) -> str | None:
    try:
        return json.loads(report.read_text())["pause"]["state"]
    except (OSError, ValueError, KeyError):
        return None


def test_an_interrupt_while_suspended_changes_nothing_and_prints_no_traceback(tmp_path):
    channel = tmp_path / "channel"
    channel.mkdir()
    log = tmp_path / "kernel.log"
    env = environment(JUPYTER_VGPU_CHAOS="suspend", JUPYTER_VGPU_CHANNEL=str(channel))
    kernel = Kernel(tmp_path, env, load_extension=True, log=log)
    report = channel / f"kernel-{kernel.id}.json"
    try:
        kernel.run("import torch\nx = torch.ones(1 << 20, device='cuda')")
        wait_for(lambda: pause_state(report) == "suspended", what="the kernel suspended after its cell")
        helpers = [
            p
            for p in psutil.Process(kernel.pid).children()
            if "jupyter_vgpu.host.checkpoint" in " ".join(p.cmdline())
        ]
        assert len(helpers) == 1, "no checkpoint helper holds the kernel"
        assert os.getpgid(helpers[0].pid) != os.getpgid(kernel.pid)

        kernel.manager.interrupt_kernel()  # SIGINT to the kernel's process group
        assert helpers[0].is_running()
        assert pause_state(report) == "suspended"
        assert kernel.run("print(x.sum().item())").strip() == "1048576.0"  # restored through the helper
    finally:
        kernel.shutdown()
    text = log.read_text()
    assert "KeyboardInterrupt" not in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
