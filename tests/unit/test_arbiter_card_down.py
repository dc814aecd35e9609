"""A card that stops answering NVML (named in ``JUPYTER_VGPU_NVML_FAIL``, which simulated
cards honour too; on real cards ``tests/gpu/test_two_gpus.py`` does the same) leaves the
other cards' kernels running: the arbiter's background look and room requests go on for
them, a cell on the failing card waits saying why and fails readably after the timeout,
and the decision log says once which card stopped answering."""

from jupyter_vgpu import nvml
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing import fault_scene as scene
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.waiting import wait_for

MiB, GiB = 2**20, 2**30
UP = Slice("GPU-sim-up", 0, "Simulated card", GiB, 600 * MiB, 50, simulated=True, idle_seconds=3600)
DOWN = UP.replace(gpu_uuid="GPU-sim-down", gpu_index=1)


def test_a_card_that_stops_answering_leaves_the_other_cards_kernels_running(tmp_path):
    arbiter = ArbiterProcess(
        tmp_path, "--queue-timeout=3", "--ArbiterApp.poll_seconds=0.2", env={nvml.FAIL_ENV: "GPU-sim-down"}
    ).start()
    ada = scene.start_kernel(tmp_path, arbiter, "ada", slice_=UP)
    bob = scene.start_kernel(tmp_path, arbiter, "bob", slice_=DOWN)
    try:
        assert ada.run("print(1 + 1)").strip() == "2"
        out = bob.run("print('must not run')")
        assert "GPU 1 does not answer" in out, out
        assert "JUPYTER_VGPU_NVML_FAIL" in out, out
        assert "MemoryError" in out, out  # denied after the queue timeout, readably
        assert "must not run" not in out
        assert ada.run("print(2 + 2)").strip() == "4"  # the other card's kernel runs on
        wait_for(lambda: arbiter.kernel(ada.pid)["state"] == "idle", 30, "ada idle in the books")
        decisions = arbiter.books()["decisions"]
        down = [d for d in decisions if d["what"] == "card unreadable"]
        assert [d["gpu"] for d in down] == ["GPU-sim-down"], down  # once, however many looks
        assert any(d["what"] == "denied" and d["server"] == "bob/" for d in decisions)
    finally:
        ada.shutdown()
        bob.shutdown()
        arbiter.stop()
