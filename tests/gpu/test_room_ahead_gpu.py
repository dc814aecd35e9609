"""A prefetch makes its cell's room while the kernel comes back, on the real card and the
driver's checkpoint.

A prefetch that brought back only a kernel's paused bytes left its cell to make the rest
of its room after the user pressed run: 11.8 s of suspends for one cell (48 MLP
sessions, seed 7 at 09f6060, ``sessions-h100.json``), where the edit before it gave 2 s.
Five kernels hold 256 MiB of random bytes each and pause, each keeping its CUDA context
on the card; the fifth (4 GiB budget) is the one prefetched (a kernel paused with nothing
off the card has nothing to bring back, and is refused). The arbiter is started again with a card
reserve set from what NVML shows, so that the fifth kernel comes back in the free memory
but its cell is about three and a half contexts short of its room. Its prefetch (the
server's word through the kernel's channel, as JupyterLab's extension sends it) suspends
those it needs at once, named ``room ahead`` in the decisions; the cell then runs with no room
left to make, and the four come back bit-exact."""

import pytest

from jupyter_vgpu import nvml
from jupyter_vgpu.server.state import ServerState
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.kernel_runner import Kernel
from jupyter_vgpu.testing.preloaded import environment
from jupyter_vgpu.testing.waiting import wait_for

from .paused_contexts import CHECK, GROW, HOLD, assert_made_together, pause_all, restart, start_holders

pytestmark = pytest.mark.gpu
GiB, MiB = 2**30, 2**20


def suspends_ahead(arbiter: ArbiterProcess) -> list[dict]:
    return [
        d
        for d in arbiter.books()["decisions"]
        if d["what"] == "suspend" and d.get("reason") == "room ahead for grower/"
    ]


def test_a_prefetch_suspends_what_its_cell_needs_together_before_the_cell_runs(tmp_path):
    gpu = nvml.list_gpus()[0]
    small = Slice.on_card(gpu, 2 * GiB, 100, overcommit_ratio=8.0)
    budget = 4 * GiB
    large = Slice.on_card(gpu, budget, 100, overcommit_ratio=8.0)
    arbiter = ArbiterProcess(tmp_path, "--ArbiterApp.suspend_after=3600").start()
    kernels = []
    channel = tmp_path / "channel"
    channel.mkdir()
    try:
        paused = start_holders(arbiter, tmp_path, small, kernels)
        # the grower's server writes its channel, as a real one does: prefetches go through it
        env = environment(
            JUPYTER_VGPU_ARBITER=str(arbiter.socket), JUPYTER_VGPU_CHANNEL=str(channel), **large.environment()
        )
        grower = Kernel(tmp_path, env, load_extension=True)
        kernels.append((grower, "grower", large))
        with arbiter.control() as c:
            c.register(grower.pid, "grower", "", large)
        assert "held" in grower.run(HOLD.format(seed=len(paused)), timeout=300)
        pause_all(arbiter, [*paused, grower])
        context = min(arbiter.kernel(k.pid)["resident"] for k in paused)  # left on the card, each
        assert context > 0
        held = arbiter.kernel(grower.pid)["resident"]
        back = arbiter.kernel(grower.pid)["paused_bytes"]
        arbiter.stop()
        # the grower comes back in the free memory, and its cell is short by about three and
        # a half contexts: the room it needs beyond what it holds, less what is left free
        free_then = budget - held - (7 * context) // 2
        assert 0 < back < free_then
        reserve = nvml.free_memory(gpu.uuid) - free_then
        arbiter = restart(
            tmp_path,
            kernels,
            [*paused, grower],
            "--ArbiterApp.suspend_after=3600",
            "--ArbiterApp.watermark=0.99",  # no pause owed to the watermark: the cell's room alone
            f"--ArbiterApp.card_reserve={reserve}",
        )

        ServerState(channel, None).prefetch(grower.id)
        try:  # the paused kernels' contexts vary a little: three or four cover the room
            wait_for(lambda: suspends_ahead(arbiter)[2:], 120, "suspends ahead of the grower's cell")
        except AssertionError as e:
            said = arbiter.log_path.read_text()[-4000:]
            raise AssertionError(
                f"{e}; the decisions: {arbiter.books()['decisions']}; the grower's report: "
                f"{arbiter.kernel(grower.pid)}; the arbiter's log ends: {said}"
            ) from None
        wait_for(lambda: (arbiter.kernel(grower.pid) or {}).get("tier") == "gpu", 60, "the grower back")
        suspends = suspends_ahead(arbiter)
        assert_made_together(suspends, "suspends ahead:")

        out = grower.run(GROW, timeout=300)
        assert "grew" in out, out[-2000:]
        made = [d for d in arbiter.books()["decisions"] if d.get("reason") == "room for grower/"]
        assert not made, made  # its room was made before it ran
        for k in [*paused, grower]:  # back from the driver's checkpoint and host memory, bit-exact
            out = k.run(CHECK, timeout=300)
            assert out.strip().splitlines()[-1] == "True", out[-2000:]
    finally:
        for k, _, _ in kernels:
            k.shutdown()
        arbiter.stop()
