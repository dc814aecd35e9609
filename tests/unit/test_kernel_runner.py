"""The test kernels' channels cannot be taken by another process between being chosen
and being bound (CI lost a run to "Address already in use" with two test workers)."""

import os
import stat

from jupyter_vgpu.testing.kernel_runner import Kernel


def test_a_kernels_channels_are_unix_sockets_of_its_own(tmp_path):
    kernel = Kernel(tmp_path, {})
    try:
        assert kernel.run("print(6 * 7)").strip() == "42"
        info = kernel.manager.get_connection_info()
        assert info["transport"] == "ipc"
        sockets = os.path.dirname(info["ip"])
        assert len(f"{info['ip']}-{info['shell_port']}") < 108  # a Unix socket's sun_path
        channels = [
            f"{info['ip']}-{info[f'{name}_port']}" for name in ("shell", "iopub", "stdin", "control", "hb")
        ]
        assert all(stat.S_ISSOCK(os.stat(path).st_mode) for path in channels), os.listdir(sockets)
    finally:
        kernel.shutdown()
    del kernel
    assert not os.path.exists(sockets)
