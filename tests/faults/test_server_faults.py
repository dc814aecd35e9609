"""A user's server dies while its kernel is paused in the disk tier. Killed (SIGKILL) or
stopped (SIGTERM), it takes its kernels with it, as Jupyter's servers do: a server
stopped shuts its kernels down, and a kernel whose server vanished ends itself within a
second (jupyter_client starts kernels with ``JPY_PARENT_PID``, which ipykernel's parent
poller watches). Either way the node lets go of the kernel within 10 s: the arbiter's
books drop it and its directory of the disk tier goes; another user's kernel keeps its
data and runs on."""

import pytest

from jupyter_vgpu.testing import fault_scene as scene
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.fault_kernels import served_kernel
from jupyter_vgpu.testing.waiting import wait_for

MiB = scene.MiB


@pytest.mark.parametrize("how", ["kill", "term"])
def test_a_server_that_dies_takes_its_paused_kernel_and_the_node_lets_go(tmp_path, how):
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
        out = scene.run(bob, scene.hold_code(2, 8 * MiB) + scene.DIGEST)
        assert out.text.strip().splitlines()[-1] == scene.digest(2, 8 * MiB), (out.error, out.text)
        wait_for(lambda: arbiter.kernel(pid)["tier"] == "disk", 10, "ada paused and moved to disk")
        assert scene.disk_dirs(tmp_path / "disk")
        scene.kill(server.proc.pid, how)
        server.proc.wait(30)
        wait_for(lambda: scene.process_state(pid) in (None, "Z"), 10, "ada's kernel to end with its server")
        wait_for(lambda: scene.books_consistent(arbiter, {bob.pid: ""}), 10, "the books without ada")
        wait_for(lambda: not scene.disk_dirs(tmp_path / "disk"), 10, "ada's disk tier directory gone")
        out = scene.run(bob, scene.DIGEST)
        assert out.text.strip().splitlines()[-1] == scene.digest(2, 8 * MiB), (out.error, out.text)
        assert out.longest_silence <= scene.SILENCE
    finally:
        if bob is not None:
            bob.shutdown()
        for k in arbiter.books()["kernels"]:
            scene.kill(k["pid"], "kill")
        if server.proc.poll() is None:
            server.stop()
        arbiter.stop()
