"""A kernel reached through its connection file alone (as the fault suite reaches one a
Jupyter server started) is waited for until it answers, not declared dead because its
heartbeat is still silent while it starts."""

import os
import sys

from jupyter_client import KernelManager

from jupyter_vgpu.testing.fault_kernels import Attached


def test_a_kernel_slow_to_start_is_waited_for(tmp_path):
    slow = tmp_path / "slow"
    slow.mkdir()
    # runs before the kernel binds its heartbeat: 2.5 s of silence, as on a busy GPU machine
    (slow / "sitecustomize.py").write_text("import time\ntime.sleep(2.5)\n")
    manager = KernelManager(kernel_name="python3", connection_file=str(tmp_path / "kernel.json"))
    manager.kernel_spec.argv[0] = sys.executable
    path = os.pathsep.join(filter(None, [str(slow), os.environ.get("PYTHONPATH")]))
    manager.start_kernel(env={**os.environ, "PYTHONPATH": path})
    try:
        kernel = Attached(manager.connection_file, timeout=60)
        reply = kernel.client.execute_interactive("1 + 1", timeout=30)
        assert reply["content"]["status"] == "ok"
        kernel.client.stop_channels()
    finally:
        manager.shutdown_kernel(now=True)
