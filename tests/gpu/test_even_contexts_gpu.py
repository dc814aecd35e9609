"""``ArbiterApp.even_contexts`` on the real card and the driver's checkpoint: two kernels
hold 256 MiB of random bytes each and pause; the arbiter, in its background step, takes
each one's CUDA context through the driver's checkpoint and straight back, neither kernel
asked nor told. Both are then paused still, their contexts restored ones, and their
next cells find their bytes bit-exact."""

import pytest

from jupyter_vgpu import nvml
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.waiting import wait_for

from .paused_contexts import CHECK, pause_all, start_holders

pytestmark = pytest.mark.gpu
GiB = 2**30


def test_paused_kernels_contexts_go_through_the_driver_once_and_their_bytes_come_back_exact(tmp_path):
    gpu = nvml.list_gpus()[0]
    slice_ = Slice.on_card(gpu, 2 * GiB, 100, overcommit_ratio=8.0)
    arbiter = ArbiterProcess(
        tmp_path, "--ArbiterApp.even_contexts=True", "--ArbiterApp.suspend_after=3600"
    ).start()
    kernels = []
    try:
        holders = start_holders(arbiter, tmp_path, slice_, kernels, n=2)
        pause_all(arbiter, holders)
        for k in holders:
            wait_for(
                lambda k=k: (arbiter.kernel(k.pid) or {}).get("restored_context"),
                120,
                f"{k.pid}'s context taken through the driver",
            )
        decisions = arbiter.books()["decisions"]
        evened = [d for d in decisions if d["what"] == "evened"]
        assert sorted(d["pid"] for d in evened) == sorted(k.pid for k in holders), decisions
        print("evened", [d["seconds"] for d in evened])
        for k in holders:
            assert arbiter.kernel(k.pid)["state"] == "paused"
        for k in holders:  # back from host memory into a restored context, bit-exact
            out = k.run(CHECK, timeout=300)
            assert out.strip().splitlines()[-1] == "True", out[-2000:]
        assert [d for d in arbiter.books()["decisions"] if d["what"] == "evened"] == evened, "once each"
    finally:
        for k, _, _ in kernels:
            k.shutdown()
        arbiter.stop()
