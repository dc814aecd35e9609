"""The test kernels' channels cannot be taken by another process between being chosen
and being bound (CI lost a run to "Address already in use" with two test workers)."""

import json
import os
import stat

from jupyter_vgpu.testing.kernel_runner import Kernel
from jupyter_vgpu.testing.server_process import JupyterServer
from jupyter_vgpu.testing.waiting import wait_for

CHANNELS = ("shell", "iopub", "stdin", "control", "hb")


def _sockets(info: dict) -> list[str]:
    """The paths of a kernel's five channels, from its connection info (``ipc`` transport)."""
    return [f"{info['ip']}-{info[f'{name}_port']}" for name in CHANNELS]


def test_a_kernels_channels_are_unix_sockets_of_its_own(tmp_path):
    kernel = Kernel(tmp_path, {})
    try:
        assert kernel.run("print(6 * 7)").strip() == "42"
        info = kernel.manager.get_connection_info()
        assert info["transport"] == "ipc"
        sockets = os.path.dirname(info["ip"])
        assert len(f"{info['ip']}-{info['shell_port']}") < 108  # a Unix socket's sun_path
        assert all(stat.S_ISSOCK(os.stat(path).st_mode) for path in _sockets(info)), os.listdir(sockets)
    finally:
        kernel.shutdown()
    del kernel
    assert not os.path.exists(sockets)


def test_a_test_servers_kernels_talk_over_unix_sockets_in_a_directory_it_removes(tmp_path):
    """The same for the kernels a test's Jupyter server starts (the browser and
    integration tests' notebooks)."""
    server = JupyterServer(tmp_path, {})
    try:
        kernel = server.request("POST", "api/kernels", json={"name": "python3"}).json()
        connection = server.runtime / f"kernel-{kernel['id']}.json"
        wait_for(connection.exists, 30, f"kernel {kernel['id']}'s connection file in {server.runtime}")
        info = json.loads(connection.read_text())
        assert info["transport"] == "ipc"
        # the package's server extension gives them a directory of their own (0700),
        # removed when the server exits (jupyter_vgpu.server.kernel_sockets)
        sockets_dir = os.path.dirname(info["ip"])
        assert sockets_dir.startswith("/tmp/jupyter-vgpu-"), sockets_dir
        assert stat.S_IMODE(os.stat(sockets_dir).st_mode) == 0o700
        assert len(f"{info['ip']}-{info['shell_port']}") < 108
        wait_for(
            lambda: all(os.path.exists(path) for path in _sockets(info)),
            60,
            f"kernel {kernel['id']} to bind its five channels",
        )
        assert all(stat.S_ISSOCK(os.stat(path).st_mode) for path in _sockets(info))
    finally:
        server.stop()
    assert not server.runtime.exists()
    assert not os.path.exists(sockets_dir)
