"""A server's kernels over the ipc transport get their Unix sockets in a short directory
of their own (:mod:`jupyter_vgpu.server.kernel_sockets`): a real kernel started through
jupyter_client's own kernel managers from a runtime directory too deep for jupyter_client's
socket names runs code, TCP and a set ``KernelManager.ip`` are left alone."""

from __future__ import annotations

import logging
import os
import stat
import subprocess

import pytest
from jupyter_client.multikernelmanager import MultiKernelManager
from traitlets.config import Config

from jupyter_vgpu.server.kernel_sockets import SOCKET_PATH_MAX, keep_short


def kernels(tmp_path, **settings) -> MultiKernelManager:
    """A MultiKernelManager whose connection files go in a runtime directory 120 bytes
    deep, its kernels' managers configured by ``settings``."""
    deep = tmp_path / ("d" * (120 - len(str(tmp_path)) - 1))
    deep.mkdir()
    config = Config()
    for name, value in settings.items():
        setattr(config.KernelManager, name, value)
    # a logger of the test's own: traitlets' default one keeps the stream pytest gave it,
    # closed by the time a failed start is logged
    return MultiKernelManager(config=config, connection_dir=str(deep), log=logging.getLogger(__name__))


def manager(multi: MultiKernelManager):
    return multi.kernel_manager_factory(
        connection_file=os.path.join(multi.connection_dir, "kernel-0123.json"), parent=multi
    )


def test_an_ipc_kernel_from_a_deep_runtime_directory_runs_code(tmp_path):
    multi = kernels(tmp_path, transport="ipc")
    default = os.path.join(multi.connection_dir, "kernel-00000000-0000-0000-0000-000000000000-ipc-1")
    assert len(default) > SOCKET_PATH_MAX, "jupyter_client's own name would be too long for a socket"
    keep_short(multi)
    kernel_id = multi.start_kernel(kernel_name="python3")
    try:
        km = multi.get_kernel(kernel_id)
        info = km.get_connection_info()
        assert info["transport"] == "ipc"
        directory = os.path.dirname(info["ip"])
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700, "only its owner may enter"
        assert os.stat(directory).st_uid == os.getuid()
        sockets = [f"{info['ip']}-{info[k]}" for k in ("shell_port", "iopub_port", "stdin_port", "hb_port")]
        client = km.blocking_client()
        client.start_channels()
        try:
            client.wait_for_ready(timeout=60)
            assert all(len(s) <= SOCKET_PATH_MAX for s in sockets), sockets
            assert all(stat.S_ISSOCK(os.stat(s).st_mode) for s in sockets), sockets
            out = []
            reply = client.execute_interactive(
                "print(6 * 7)",
                timeout=60,
                output_hook=lambda m: out.append(m["content"].get("text", "")),
            )
            assert reply["content"]["status"] == "ok"
            assert "".join(out).strip() == "42"
        finally:
            client.stop_channels()
    finally:
        multi.shutdown_all(now=True)


def test_without_it_the_deep_runtime_directory_refuses_the_kernel(tmp_path):
    import zmq

    multi = kernels(tmp_path, transport="ipc")
    try:
        with pytest.raises(zmq.ZMQError, match="File name too long"):
            multi.start_kernel(kernel_name="python3", stderr=subprocess.DEVNULL)  # its bind's failure
    finally:
        multi.shutdown_all(now=True)


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({}, "tcp, jupyter_client's default"),
        ({"transport": "ipc", "ip": "/run/mine/k"}, "an ip set by an admin"),
    ],
)
def test_tcp_and_a_set_address_are_left_alone(tmp_path, settings, why):
    multi = kernels(tmp_path, **settings)
    before = manager(multi).ip
    made = []
    keep_short(multi, make_dir=lambda: made.append(1) or str(tmp_path))
    assert manager(multi).ip == before, why
    assert not made, "no directory made for them"


def test_every_ipc_kernel_of_a_server_shares_one_directory_made_once(tmp_path):
    multi = kernels(tmp_path, transport="ipc")
    made = []

    def make_dir():
        made.append(str(tmp_path / f"short{len(made)}"))
        os.mkdir(made[-1], 0o700)
        return made[-1]

    keep_short(multi, make_dir=make_dir)
    first = multi.kernel_manager_factory(
        connection_file=f"{multi.connection_dir}/kernel-a.json", parent=multi
    )
    second = multi.kernel_manager_factory(
        connection_file=f"{multi.connection_dir}/kernel-b.json", parent=multi
    )
    assert made == [str(tmp_path / "short0")]
    assert (first.ip, second.ip) == (f"{made[0]}/kernel-a", f"{made[0]}/kernel-b")
