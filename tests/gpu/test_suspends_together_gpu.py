"""Suspends made together for one cell's room, on the real card and the driver's checkpoint.

A paused kernel's suspend frees its CUDA context alone, so one cell's room can take many;
made one after another they kept a cell waiting 10.7 s (48 MLP sessions at 4558c36,
``sessions-h100.json``). Four kernels hold 256 MiB of random bytes each and pause; a
fifth stays idle on the card. The arbiter is then started again with a card reserve set
from what NVML shows, so that the fifth kernel's next cell is short of about three and a
half contexts: the arbiter suspends the four at once (their decisions' spans overlap),
the cell runs, and the four come back bit-exact."""

import pytest

from jupyter_vgpu import nvml
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess

from .paused_contexts import CHECK, GROW, assert_made_together, pause_all, restart, start_holders

pytestmark = pytest.mark.gpu
GiB, MiB = 2**30, 2**20


def test_the_suspends_for_one_cells_room_are_made_together_and_come_back_exact(tmp_path):
    gpu = nvml.list_gpus()[0]
    small = Slice.on_card(gpu, 2 * GiB, 100, overcommit_ratio=8.0)
    budget = 4 * GiB
    large = Slice.on_card(gpu, budget, 100, overcommit_ratio=8.0)
    arbiter = ArbiterProcess(tmp_path, "--ArbiterApp.suspend_after=3600").start()
    kernels = []
    try:
        paused = start_holders(arbiter, tmp_path, small, kernels)
        grower = arbiter.start_kernel(tmp_path, "grower", large)
        kernels.append((grower, "grower", large))
        assert "ok" in grower.run("import torch\ntorch.zeros(1, device='cuda')\nprint('ok')", timeout=300)
        pause_all(arbiter, paused)
        context = min(arbiter.kernel(k.pid)["resident"] for k in paused)  # left on the card, each
        assert context > 0
        held = arbiter.kernel(grower.pid)["resident"]
        arbiter.stop()
        # the grower's cell is short by about three and a half contexts: the room it needs
        # beyond what it holds, less what the reserve leaves free
        free_then = budget - held - (7 * context) // 2
        reserve = nvml.free_memory(gpu.uuid) - free_then
        arbiter = restart(
            tmp_path,
            kernels,
            paused,
            "--ArbiterApp.suspend_after=3600",
            "--ArbiterApp.watermark=0.99",  # no background pause of the grower, idle meanwhile
            f"--ArbiterApp.card_reserve={reserve}",
        )

        out = grower.run(GROW, timeout=300)
        assert "grew" in out, out[-2000:]
        decisions = arbiter.books()["decisions"]
        suspends = [d for d in decisions if d["what"] == "suspend" and d.get("reason") == "room for grower/"]
        assert len(suspends) >= 3, decisions
        assert_made_together(suspends, "suspends together:")
        for k in paused:  # back from the driver's checkpoint and from host memory, bit-exact
            out = k.run(CHECK, timeout=300)
            assert out.strip().splitlines()[-1] == "True", out[-2000:]
    finally:
        for k, _, _ in kernels:
            k.shutdown()
        arbiter.stop()
