"""A kernel dies at every step of the memory path (kill -9, and SIGTERM): pausing for
another kernel, after the pause before it answers, resuming, moving to the disk tier.

Each case starts a victim (ada) holding real bytes beside a survivor (bob, real bytes
too), drives ada to the named step (a failpoint stops her there), kills her, and checks:
the cell that was waiting on her (bob's) ends with no stretch of more than 2 s without a
message; the arbiter's books drop her (and keep bob) within 10 s; her directory of the
disk tier is gone within 10 s; bob's bytes are bit-identical after he comes back.

One arbiter and one bob serve every case (a case takes a few seconds: a new ada). The
node's host budget is set so that a paused ada holds more than its spill mark: she moves
to the disk tier as soon as she is paused, and resumes stream back from disk.
"""

import pytest

from jupyter_vgpu.testing import fault_scene as scene
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.waiting import wait_for

MiB = scene.MiB
ADA_BYTES, BOB_BYTES = 24 * MiB, 4 * MiB


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kernel-faults")
    arbiter = ArbiterProcess(
        tmp,
        "--queue-timeout=60",
        f"--ArbiterApp.disk_dir={tmp / 'disk'}",
        "--ArbiterApp.host_memory_limit=900M",
        "--ArbiterApp.host_spill_fraction=0.01",  # any paused kernel past 9 MiB goes to disk
        "--ArbiterApp.disk_reserve=1M",
    ).start()
    bob = scene.start_kernel(tmp, arbiter, "bob")
    assert not scene.run(bob, scene.hold_code(2, BOB_BYTES)).error
    victims: list = []
    yield tmp, arbiter, bob, victims
    for ada in victims:  # one a failed case left stopped at its step
        scene.reap(ada)
    bob.shutdown()
    arbiter.stop()


def ada_at(node, step: str):
    """A new ada, holding real bytes and 700 MiB of the simulated card, armed to stop at ``step``."""
    tmp, arbiter, _, victims = node
    ada = scene.start_kernel(tmp, arbiter, "ada", {"JUPYTER_VGPU_FAILPOINTS": f"{step}=stop"})
    victims.append(ada)
    out = scene.run(ada, scene.hold_code(1, ADA_BYTES, simulated_mib=700))
    assert out.error is None, out.error
    assert "Error" not in out.text, out.text
    wait_for(
        lambda: (arbiter.kernel(ada.pid) or {}).get("resident", 0) >= 700 * MiB,
        30,
        "ada's memory in the books",
    )
    return ada


def after_death(node, ada, waiting: scene.Background | None):
    """The invariants once ada is dead."""
    tmp, arbiter, bob, _ = node
    if waiting is not None:
        out = waiting.join(90)
        assert out.error is None, out.error
        assert out.text.rstrip().endswith("bob ran"), out.text
        assert out.longest_silence <= scene.SILENCE, (out.longest_silence, out.text)
    scene.reap(ada)
    wait_for(lambda: scene.books_consistent(arbiter, {bob.pid: ""}), 10, "the books to hold bob alone")
    wait_for(lambda: not [d for d in scene.disk_dirs(tmp / "disk") if f"-{ada.pid}-" in d.name], 10,
             "ada's directory of the disk tier to be removed")  # fmt: skip
    out = scene.run(bob, scene.DIGEST)
    assert out.text.strip().splitlines()[-1] == scene.digest(2, BOB_BYTES), out.text
    assert out.longest_silence <= scene.SILENCE, (out.longest_silence, out.text)


PAUSE_STEPS = ["kernel.pause.start", "kernel.pause.copy", "kernel.pause.release", "kernel.pause.reply"]


@pytest.mark.parametrize(
    ("step", "how"),
    [(s, "kill") for s in PAUSE_STEPS] + [("kernel.pause.copy", "term"), ("kernel.pause.reply", "term")],
)
def test_a_kernel_killed_while_it_is_paused_for_another(node, step, how):
    bob = node[2]
    ada = ada_at(node, step)
    waiting = scene.Background(bob, "print('bob ran')")  # needs ada's room: she is paused for him
    scene.stopped_at_failpoint(ada.pid, f"ada at {step}")
    waiting.said(3)  # bob waits for her, seconds long, and says so
    scene.kill(ada.pid, how)
    after_death(node, ada, waiting)


def paused_ada(node, step: str):
    """An ada armed at ``step``, paused for bob (and moved to the disk tier)."""
    bob = node[2]
    ada = ada_at(node, step)
    out = scene.run(bob, "print('bob ran')")
    assert out.text.rstrip().endswith("bob ran"), out.text
    return ada


@pytest.mark.parametrize(
    ("step", "how"),
    [("kernel.resume.mapped", "kill"), ("kernel.resume.copy", "kill"), ("kernel.resume.copy", "term")],
)
def test_a_kernel_killed_while_it_comes_back(node, step, how):
    arbiter = node[1]
    ada = paused_ada(node, step)
    wait_for(lambda: arbiter.kernel(ada.pid)["tier"] == "disk", 30, "ada moved to the disk tier")
    scene.Background(ada, scene.DIGEST, timeout=20)  # her resume stops at the step; she dies in it
    scene.stopped_at_failpoint(ada.pid, f"ada at {step}")
    scene.kill(ada.pid, how)
    after_death(node, ada, None)


@pytest.mark.parametrize(
    ("step", "how"),
    [("kernel.spill.write", "kill"), ("kernel.spill.written", "kill"), ("kernel.spill.write", "term")],
)
def test_a_kernel_killed_while_it_moves_to_disk(node, step, how):
    tmp = node[0]
    ada = paused_ada(node, step)  # the arbiter moves her to disk at once: she stops there
    scene.stopped_at_failpoint(ada.pid, f"ada at {step}")
    assert [d for d in scene.disk_dirs(tmp / "disk") if f"-{ada.pid}-" in d.name], "she had begun writing"
    scene.kill(ada.pid, how)
    after_death(node, ada, None)
