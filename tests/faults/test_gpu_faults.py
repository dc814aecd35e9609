"""The fault-injection suite on a real card (``pytest -m gpu tests/faults``): the GPU codec
path (nvCOMP, pinned slabs, the disk tier's files), the driver's checkpoint, and the
node's host memory under pressure.

Kernels run with the pausable allocator preloaded (as a jupyter-vgpu server starts
them). A victim holds two 1 GiB tensors of bf16-like weights; an asker's budget is set
to what the card has free plus 1.5 GiB, so its next cell needs the victim paused. Data
are checked with the SHA-256 the kernel printed before the fault.
"""

from __future__ import annotations

import threading

import pytest

from jupyter_vgpu.testing import fault_scene as scene
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.fault_kernels import (
    DIGEST,
    fill,
    gpu_kernel,
    gpu_slice,
    needs_the_victim,
    same,
)
from jupyter_vgpu.testing.waiting import wait_for


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU (pytest -m gpu)")]
GiB, MiB = 2**30, 2**20


# -- a kernel dies at a step of the GPU path ------------------------------------------------


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-faults")
    arbiter = ArbiterProcess(
        tmp,
        "--queue-timeout=120",
        f"--ArbiterApp.disk_dir={tmp / 'disk'}",
        "--ArbiterApp.host_memory_limit=64G",
        "--ArbiterApp.host_spill_fraction=0.01",  # a paused victim goes to the disk tier at once
    ).start()
    asker = gpu_kernel(tmp, arbiter, "asker", 8 * GiB)
    expected = fill(asker, 99, n=1)
    victims: list = []
    yield tmp, arbiter, asker, expected, victims
    for victim in victims:  # one a failed case left stopped at its step
        scene.reap(victim)
    asker.shutdown()
    arbiter.stop()


STEPS = [
    "kernel.pause.start",
    "kernel.pause.copy",
    "kernel.pause.release",
    "kernel.pause.reply",
    "kernel.spill.write",
    "kernel.spill.written",
    "kernel.resume.mapped",
    "kernel.resume.copy",
]


@pytest.mark.parametrize("step", STEPS)
def test_a_kernel_dies_at_a_step_of_the_gpu_path(node, step):
    tmp, arbiter, asker, expected, victims = node
    victim = gpu_kernel(tmp, arbiter, "victim", 8 * GiB, env={"JUPYTER_VGPU_FAILPOINTS": f"{step}=stop"})
    victims.append(victim)
    fill(victim, 1)
    needs_the_victim(arbiter, asker)
    if step.startswith("kernel.pause"):
        cell = scene.Background(asker, "print('asker ran')", timeout=300)
    else:  # paused (and moved to disk) first, then the step
        out = scene.run(asker, "print('asker ran')", timeout=300)
        assert out.text.rstrip().endswith("asker ran"), out.text
        if step.startswith("kernel.resume"):
            wait_for(
                lambda: arbiter.kernel(victim.pid)["tier"] == "disk" or step.endswith("mapped"), 60, "on disk"
            )
            scene.Background(victim, DIGEST, timeout=30)
        cell = None
    scene.stopped_at_failpoint(victim.pid, f"the victim at {step}", timeout=120)
    if cell is not None:
        cell.said(3)  # the asker waits for the victim, and says so
    scene.kill(victim.pid, "kill")
    if cell is not None:
        out = cell.join(300)
        assert out.text.rstrip().endswith("asker ran"), out.text
        assert out.longest_silence <= scene.SILENCE, (out.longest_silence, out.text)
    scene.reap(victim)
    wait_for(
        lambda: scene.books_consistent(arbiter, {asker.pid: ""}), 10, "the books to hold the asker alone"
    )
    wait_for(lambda: not [d for d in scene.disk_dirs(tmp / "disk") if f"-{victim.pid}-" in d.name], 10,
             "the victim's disk tier directory removed")  # fmt: skip
    same(asker, expected)


# -- the driver's checkpoint: its holder dies --------------------------------------------


@pytest.mark.parametrize(
    "step", ["arbiter.suspend", "checkpoint.locked", "arbiter.restore", "checkpoint.restored"]
)
def test_a_suspended_kernel_whose_arbiter_dies_is_restored_or_unlocked(tmp_path, step):
    args = (
        "--queue-timeout=120",
        "--ArbiterApp.suspend_after=1",  # paused for the asker, then suspended once the card is quiet
        f"--ArbiterApp.disk_dir={tmp_path / 'disk'}",
    )
    arbiter = ArbiterProcess(tmp_path, *args).start()
    victim = gpu_kernel(tmp_path, arbiter, "victim", 8 * GiB)
    asker = gpu_kernel(tmp_path, arbiter, "asker", 8 * GiB)
    try:
        expected = fill(victim, 2)
        arbiter.stop()  # armed from here on
        arbiter.env = {"JUPYTER_VGPU_FAILPOINTS": f"{step}=stop"}
        arbiter.start()
        wait_for(
            lambda: scene.books_consistent(arbiter, {victim.pid: "gpu", asker.pid: "gpu"}), 10, "whole books"
        )
        needs_the_victim(arbiter, asker)
        if step.startswith("arbiter.restore") or step == "checkpoint.restored":
            # suspended first (paused for the asker, then suspended in the background), then asked back
            assert scene.run(asker, "print('asker ran')", timeout=300).text.rstrip().endswith("asker ran")
            wait_for(lambda: arbiter.kernel(victim.pid)["tier"] == "suspended", 60, "the victim suspended")
            cell = scene.Background(victim, scene.BACK + DIGEST, timeout=300)
        else:
            cell = scene.Background(asker, scene.BACK, timeout=300)
        holders = [arbiter.process.pid]
        if step.startswith("checkpoint."):
            # reached in the arbiter's checkpoint worker (node/checkpoint_pool.py): the arbiter and
            # its worker die together, as when its service is stopped or its cgroup OOM-killed
            worker = f"the arbiter's checkpoint worker at {step}"
            holders.append(scene.stopped_below(arbiter.process.pid, worker))
        else:
            scene.stopped_at_failpoint(arbiter.process.pid, f"the arbiter at {step}", timeout=120)
        for pid in holders:
            scene.kill(pid, "kill")
        arbiter.process.wait(30)
        out = cell.join(300)  # whoever waited goes on without the arbiter, with a word each second
        assert out.silence_until("back") <= scene.SILENCE, (out.silence_until("back"), out.text)
        arbiter.env = {}
        arbiter.start()
        wait_for(lambda: scene.books_consistent(arbiter, {victim.pid: "", asker.pid: ""}), 5, "whole books")
        same(victim, expected)  # restored, or unlocked, never left locked
        decisions = [d["what"] for d in arbiter.books()["decisions"]]
        assert "unlock failed" not in decisions
    finally:
        victim.shutdown()
        asker.shutdown()
        arbiter.stop()


def test_a_kernel_whose_checkpoint_helper_dies_restores_itself(tmp_path):
    # chaos mode "suspend": after every cell the kernel pauses, then a helper process
    # checkpoints it; the helper stops at "checkpoint.held" and is killed there
    env = {"JUPYTER_VGPU_CHAOS": "suspend", "JUPYTER_VGPU_FAILPOINTS": "checkpoint.held=stop"}
    kernel = gpu_kernel(tmp_path, None, "ada", 8 * GiB, env=env)
    import psutil

    def helpers():
        return [
            c for c in psutil.Process(kernel.pid).children() if "jupyter_vgpu.host.checkpoint" in c.cmdline()
        ]

    try:
        expected = fill(kernel, 3)
        found = wait_for(helpers, 120, "the checkpoint helper")[0]
        scene.stopped_at_failpoint(found.pid, "the helper holding the checkpoint")
        scene.kill(found.pid, "kill")
        same(kernel, expected)  # restored by a helper of its own
    finally:
        for helper in helpers():  # the next cell's helper stopped at the same step
            helper.kill()
        kernel.shutdown()


def test_without_an_arbiter_and_no_room_a_cell_fails_readably_and_keeps_the_data(tmp_path):
    # the asker's budget is the whole card: the victim's CUDA context must go too (paused,
    # then suspended for room: suspend_after's default lets the arbiter do so)
    arbiter = ArbiterProcess(tmp_path, "--queue-timeout=120").start()
    victim = gpu_kernel(tmp_path, arbiter, "victim", 8 * GiB, args=("--VGPUKernel.resume_timeout=5",))
    asker = gpu_kernel(tmp_path, arbiter, "asker", gpu_slice(GiB).gpu_memory)  # the whole card
    try:
        expected = fill(victim, 4)
        assert scene.run(asker, "print('asker ran')", timeout=300).text.rstrip().endswith("asker ran")
        wait_for(lambda: arbiter.kernel(victim.pid)["tier"] in ("host", "suspended"), 60, "the victim away")
        arbiter.process.kill()
        arbiter.process.wait(30)
        # the asker takes what is free but 256 MiB: the victim cannot come back
        hog = (
            "import torch\nfree, _ = torch.cuda.mem_get_info()\n"
            "hog = torch.empty(free - 2**28, dtype=torch.uint8, device='cuda')"
        )
        assert scene.run(asker, hog, timeout=300).error is None
        out = scene.run(victim, DIGEST, timeout=120)
        assert "MemoryError" in out.text, out.text
        assert "kept in host memory" in out.text, out.text
        assert out.longest_silence <= scene.SILENCE, (out.longest_silence, out.text)
        scene.run(asker, "del hog\ntorch.cuda.empty_cache()")
        same(victim, expected)  # the card has room now: back on its own, bit-exact
    finally:
        victim.shutdown()
        asker.shutdown()
        arbiter.stop()


# -- host memory under pressure -------------------------------------------------------------


def test_paused_working_sets_past_the_host_budget_go_to_disk_and_come_back(tmp_path):
    """Five kernels of 6 GiB each take turns on the card, of which a process outside the
    arbiter (ballast) leaves 24 GiB free: a few fit at once. Their paused sets (about
    4.3 GiB each in host memory, bf16 weights compress 1.4x) sum past an 8 GiB budget, so
    the coldest move to disk. Idle kernels pin host memory ahead of their next pause
    (``VGPUKernel.prepare_pinned``) while the node's figure is under half the budget, and
    that memory counts too. The host's available memory never drops below the reserve,
    the kernels never hold more host memory than the budget, and every byte comes back.
    (The ballast keeps the bytes moved, hashed and spilled to a few tens of GiB.)"""
    from jupyter_vgpu.host.meminfo import meminfo
    from jupyter_vgpu.testing import card_holder
    from jupyter_vgpu.testing.fault_kernels import card_free

    reserve, limit = 16 * GiB, 8 * GiB
    ballast = card_holder.hold(card_free() - 24 * GiB)
    arbiter = ArbiterProcess(
        tmp_path,
        "--queue-timeout=300",
        "--ArbiterApp.suspend_after=0",
        f"--ArbiterApp.disk_dir={tmp_path / 'disk'}",
        f"--ArbiterApp.host_memory_limit={limit}",
        f"--ArbiterApp.host_reserve={reserve}",
    ).start()
    lowest = [meminfo()["MemAvailable"]]
    held = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            lowest[0] = min(lowest[0], meminfo()["MemAvailable"])
            try:
                held[0] = max(held[0], arbiter.books()["node"]["host_used"])
            except OSError:
                pass
            stop.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    kernels, expected = [], []
    try:
        for i in range(5):
            k = gpu_kernel(tmp_path, arbiter, f"user{i}", 10 * GiB)  # 6 GiB and the fill's 2 GiB temporaries
            kernels.append(k)
        for i, k in enumerate(kernels):  # each fills 6 GiB in turn; the card holds three of them
            expected.append(fill(k, 10 + i, n=6))
        for i, k in enumerate(kernels):  # everyone again: from host memory or from disk
            same(k, expected[i])
        decisions = [d["what"] for d in arbiter.books()["decisions"]]
        assert "spill" in decisions, decisions
        assert "spill failed" not in decisions
    finally:
        stop.set()
        watcher.join()
        for k in kernels:
            k.shutdown()
        arbiter.stop()
        ballast.kill()
        ballast.wait()
    assert lowest[0] >= reserve, f"MemAvailable fell to {lowest[0] / GiB:.1f} GiB"
    assert held[0] <= limit, f"the kernels held {held[0] / GiB:.1f} GiB of host memory"
