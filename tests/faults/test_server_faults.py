"""A user's server dies while its kernel is paused. Killed (SIGKILL), it leaves the kernel
running: the kernel keeps its data, the arbiter keeps it in its books, and it comes back
bit-exact when it runs a cell (reached through its connection file, as a restarted
server would). Stopped (SIGTERM), the server shuts its kernels down, as it is meant to:
the arbiter's books drop the kernel and its directory of the disk tier goes."""

import json

import pytest

from jupyter_vgpu.testing import fault_scene as scene
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.fault_kernels import served_kernel
from jupyter_vgpu.testing.waiting import wait_for

MiB = scene.MiB


@pytest.mark.parametrize("how", ["kill", "term"])
def test_a_paused_kernel_outlives_its_server(tmp_path, how):
    arbiter = ArbiterProcess(
        tmp_path,
        "--queue-timeout=60",
        f"--ArbiterApp.disk_dir={tmp_path / 'disk'}",
        "--ArbiterApp.disk_reserve=1M",
        "--ArbiterApp.host_memory_limit=900M",
        "--ArbiterApp.host_spill_fraction=0.001",  # paused, ada moves to the disk tier
    ).start()
    served = served_kernel(tmp_path, arbiter)
    server, ada, pid = served.server, served.kernel, served.pid
    bob = None
    try:
        out = scene.run(ada, scene.hold_code(1, 16 * MiB, simulated_mib=700))
        assert out.error is None, (out.error, out.text)
        assert "Error" not in out.text, out.text
        bob = scene.start_kernel(tmp_path, arbiter, "bob")
        assert scene.run(bob, "print('bob ran')").text.strip() == "bob ran"
        wait_for(lambda: arbiter.kernel(pid)["tier"] == "disk", 10, "ada paused and moved to disk")
        assert scene.disk_dirs(tmp_path / "disk")
        scene.kill(server.proc.pid, how)
        server.proc.wait(30)
        if how == "term":  # a server asked to stop ends its kernels first
            wait_for(lambda: scene.books_consistent(arbiter, {bob.pid: "gpu"}), 10, "the books without ada")
            wait_for(lambda: not scene.disk_dirs(tmp_path / "disk"), 10, "ada's disk tier directory gone")
            return
        assert scene.process_state(pid) not in (None, "Z"), "the kernel outlives its server"
        assert scene.books_consistent(arbiter, {pid: "disk", bob.pid: "gpu"})
        out = scene.run(ada, scene.DIGEST)
        assert out.text.strip().splitlines()[-1] == scene.digest(1, 16 * MiB), out.text
        assert out.longest_silence <= scene.SILENCE
        info = json.loads(served.connection_file.read_text())
        assert info["key"]  # the connection file a restarted server would read is intact
    finally:
        if bob is not None:
            bob.shutdown()
        for k in arbiter.books()["kernels"]:
            scene.kill(k["pid"], "kill")
        if server.proc.poll() is None:
            server.stop()
        arbiter.stop()
