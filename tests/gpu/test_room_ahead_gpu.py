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
left to make, and the five come back bit-exact. Where the grower's own bytes are short of
room (a context and a half), the prefetch suspends for them before it is granted."""

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


class Node:
    """Four holders and the grower, paused, their arbiter stopped (:meth:`start`; the
    fixture closes whatever it started): :meth:`restart` starts the one a test prefetches
    with (its card reserve leaving ``free`` bytes free, bytes); ``context``: the smallest
    of the holders' contexts left on the card, ``held``: the grower's, ``back``: its
    paused bytes, ``budget``: its budget (bytes)."""

    def __init__(self, tmp_path):
        self.tmp_path, self.kernels, self.arbiter = tmp_path, [], None

    def start(self, more: int = 0) -> "Node":
        """``more``: bytes the grower holds beside its 256 MiB (ones, not checked), so that
        what it brings back can exceed a context and a half."""
        self.gpu = nvml.list_gpus()[0]
        small = Slice.on_card(self.gpu, 2 * GiB, 100, overcommit_ratio=8.0)
        self.budget = 4 * GiB
        large = Slice.on_card(self.gpu, self.budget, 100, overcommit_ratio=8.0)
        self.arbiter = ArbiterProcess(self.tmp_path, "--ArbiterApp.suspend_after=3600").start()
        self.channel = self.tmp_path / "channel"
        self.channel.mkdir()
        self.paused = start_holders(self.arbiter, self.tmp_path, small, self.kernels)
        # the grower's server writes its channel, as a real one does: prefetches go through it
        env = environment(
            JUPYTER_VGPU_ARBITER=str(self.arbiter.socket),
            JUPYTER_VGPU_CHANNEL=str(self.channel),
            **large.environment(),
        )
        self.grower = Kernel(self.tmp_path, env, load_extension=True)
        self.kernels.append((self.grower, "grower", large))
        with self.arbiter.control() as c:
            c.register(self.grower.pid, "grower", "", large)
        assert "held" in self.grower.run(HOLD.format(seed=len(self.paused)), timeout=300)
        if more:
            self.grower.run(f"more = torch.ones({more}, dtype=torch.uint8, device='cuda')", timeout=300)
        pause_all(self.arbiter, [*self.paused, self.grower])
        self.context = min(self.arbiter.kernel(k.pid)["resident"] for k in self.paused)
        assert self.context > 0
        self.held = self.arbiter.kernel(self.grower.pid)["resident"]
        self.back = self.arbiter.kernel(self.grower.pid)["paused_bytes"]
        assert self.back > 0
        self.arbiter.stop()
        return self

    def restart(self, free: int) -> ArbiterProcess:
        reserve = nvml.free_memory(self.gpu.uuid) - free
        self.arbiter = restart(
            self.tmp_path,
            self.kernels,
            [*self.paused, self.grower],
            "--ArbiterApp.suspend_after=3600",
            "--ArbiterApp.watermark=0.99",  # no pause owed to the watermark: the room alone
            f"--ArbiterApp.card_reserve={reserve}",
        )
        return self.arbiter

    def prefetch_until(self, n: int) -> list[dict]:
        """Prefetch the grower, as its server does, and wait for ``n`` suspends ahead of it;
        on a timeout, the decisions, the grower's entry and the arbiter's log say why."""
        ServerState(self.channel, None).prefetch(self.grower.id)
        try:
            wait_for(lambda: suspends_ahead(self.arbiter)[n - 1 :], 120, f"{n} suspends ahead of the grower")
        except AssertionError as e:
            said = self.arbiter.log_path.read_text()[-4000:]
            raise AssertionError(
                f"{e}; the decisions: {self.arbiter.books()['decisions']}; the grower's report: "
                f"{self.arbiter.kernel(self.grower.pid)}; the arbiter's log ends: {said}"
            ) from None
        back = lambda: (self.arbiter.kernel(self.grower.pid) or {}).get("tier") == "gpu"  # noqa: E731
        wait_for(back, 60, "the grower back")
        return suspends_ahead(self.arbiter)

    def check_all(self) -> None:
        """Every kernel's bytes, back from the driver's checkpoint or host memory, bit-exact."""
        for k in [*self.paused, self.grower]:
            out = k.run(CHECK, timeout=300)
            assert out.strip().splitlines()[-1] == "True", out[-2000:]

    def close(self) -> None:
        for k, _, _ in self.kernels:
            k.shutdown()
        if self.arbiter is not None:
            self.arbiter.stop()


@pytest.fixture
def node(tmp_path):
    made = Node(tmp_path)
    yield made
    made.close()


def test_a_prefetch_suspends_what_its_cell_needs_together_before_the_cell_runs(node):
    n = node.start()
    # the grower comes back in the free memory, and its cell is short by about three and
    # a half contexts: the room it needs beyond what it holds, less what is left free
    free = n.budget - n.held - (7 * n.context) // 2
    assert n.back < free
    arbiter = n.restart(free)
    # the paused kernels' contexts vary a little: three or four cover the room
    assert_made_together(n.prefetch_until(3), "suspends ahead:")
    out = n.grower.run(GROW, timeout=300)
    assert "grew" in out, out[-2000:]
    made = [d for d in arbiter.books()["decisions"] if d.get("reason") == "room for grower/"]
    assert not made, made  # its room was made before it ran
    n.check_all()


def test_a_prefetch_short_of_its_own_return_suspends_for_it_before_the_grant(node):
    # the grower brings back more than a context and a half (256 MiB alone did not: the
    # free memory asked for below was less than nothing, so every suspend left the card
    # as full as before; H200, 77fe161, gpu-tests-h200.log)
    n = node.start(more=GiB)
    # a context and a half short of bringing the grower's bytes back: two of the paused
    # kernels' suspends, together, before the prefetch is granted
    free = n.back - (3 * n.context) // 2
    assert free > 0, (n.back, n.context)
    arbiter = n.restart(free)
    suspends = n.prefetch_until(2)
    [granted] = [d for d in arbiter.books()["decisions"] if d["what"] == "prefetch"]
    first = sorted(suspends, key=lambda d: d["time"])[:2]
    assert all(d["time"] <= granted["time"] for d in first), (first, granted)
    assert_made_together(first, "suspends for the return:")
    n.check_all()
