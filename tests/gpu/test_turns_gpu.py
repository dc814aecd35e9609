"""Cells take turns on the real card (``ArbiterApp.turn_wait``).

Two kernels (ada and bob, 16 GiB slices that fit the card together) each run a cell of
bf16 matmuls sized to about a second alone; bob's is sent once ada's code has started.
Sharing the card (``turn_wait`` 0), both take about twice a cell alone; taking turns
(the arbiter started again with ``turn_wait`` 5), ada's takes about a cell alone and
bob's waits for it, then runs alone: the pair's summed latency is lower, and the second
cell's no higher than sharing gave it. Each run prints its figures (``-s`` shows them).
"""

import json

import pytest

from jupyter_vgpu import nvml
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing import fault_scene as scene
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.kernel_runner import Kernel
from jupyter_vgpu.testing.preloaded import environment

from .paused_contexts import restart

pytestmark = pytest.mark.gpu
GiB = 2**30

SETUP = "import time, torch\na = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)\ny = a @ a"
#: ``n`` matmuls of 8192 x 8192 in bf16; says when its code starts, then its own seconds.
STEP = (
    "print('started', flush=True)\n"
    "t0 = time.perf_counter()\n"
    "for _ in range({n}):\n"
    "    y = a @ a\n"
    "torch.cuda.synchronize()\n"
    "print(f'ran {{time.perf_counter() - t0:.3f}}')"
)


def pair(ada: Kernel, bob: Kernel, code: str) -> dict:
    """Ada's cell, and bob's sent once ada's code runs: each one's seconds from send to
    reply, and bob's own seconds in its code."""
    first = scene.Background(ada, code)
    first.said(1, timeout=60)
    second = scene.run(bob, code, timeout=120)
    done = first.join(120)
    for out in (done, second):
        assert out.error is None, out.error
        assert "ran " in out.text, out.text
    return {
        "ada_s": done.ended - done.sent,
        "bob_s": second.ended - second.sent,
        "bob_code_s": float(second.text.split("ran ")[1].split()[0]),
    }


def test_a_cell_that_takes_its_turn_ends_sooner_and_the_next_no_later(tmp_path):
    gpu = nvml.list_gpus()[0]
    slice_ = Slice.on_card(gpu, 16 * GiB, 100, overcommit_ratio=8.0, idle_seconds=3600)
    arbiter = ArbiterProcess(tmp_path, "--ArbiterApp.turn_wait=0").start()
    kernels = []
    try:
        for user in ("ada", "bob"):
            env = environment(JUPYTER_VGPU_ARBITER=str(arbiter.socket), **slice_.environment())
            kernel = Kernel(tmp_path, env, load_extension=True)
            kernels.append((kernel, user, slice_))
            with arbiter.control() as c:
                c.register(kernel.pid, user, "", slice_)
            assert "Error" not in kernel.run(SETUP, timeout=300)
        (ada, _, _), (bob, _, _) = kernels
        probe = scene.run(ada, STEP.format(n=100), timeout=120)
        n = max(20, round(100 / float(probe.text.split("ran ")[1].split()[0])))  # about 1 s alone
        alone = scene.run(ada, STEP.format(n=n), timeout=120)
        alone_s = alone.ended - alone.sent
        sharing = pair(ada, bob, STEP.format(n=n))
        arbiter.stop()
        arbiter = restart(tmp_path, kernels, [], "--ArbiterApp.turn_wait=5")
        turns = pair(ada, bob, STEP.format(n=n))
        decisions = [d for d in arbiter.books()["decisions"] if d["what"] == "turn"]
        print(
            json.dumps(
                {"n": n, "alone_s": alone_s, "sharing": sharing, "turns": turns, "decisions": decisions}
            )
        )
        assert sharing["ada_s"] > 1.5 * alone_s, (sharing, alone_s)  # the card was shared
        assert turns["ada_s"] < 1.3 * alone_s, (turns, alone_s)  # ada's cell ran alone
        assert turns["bob_code_s"] < 1.3 * alone_s, turns  # and then bob's, alone
        assert turns["bob_s"] < sharing["bob_s"] + 0.3 * alone_s, (turns, sharing)
        assert turns["ada_s"] + turns["bob_s"] < sharing["ada_s"] + sharing["bob_s"], (turns, sharing)
        assert [d["server"] for d in decisions] == ["bob/"], decisions
        assert decisions[0]["message"].endswith("its turn came"), decisions
    finally:
        for kernel, _, _ in kernels:
            kernel.shutdown()
        arbiter.stop()
