"""Which way a kernel leaves the card when part of its memory must stay there.

The policy of :class:`~jupyter_vgpu.kernel.pausing.PauseControl`, driven through its
public calls (``take_off``, ``pause``, ``prepare_suspend``, the ``%vgpu status`` figures)
with stand-ins for the three things this machine lacks: the pausable allocator's figures
(what the driver's hooks counted), the engine that moves the bytes (it records that it
ran), and NVML's list of GPU processes (a real child process stands in one test). On the
GPU, ``tests/gpu/test_coverage.py`` runs the same with a real worker sharing memory
through CUDA IPC.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading

import pytest

from jupyter_vgpu.kernel import blockers
from jupyter_vgpu.kernel import gate as g
from jupyter_vgpu.kernel.config import VGPUKernel
from jupyter_vgpu.kernel.pause.vmm import Figures
from jupyter_vgpu.kernel.pausing import PauseControl

GiB = 2**30
FIELDS = Figures.__dataclass_fields__
USER_THREAD = "a user's thread"


@pytest.fixture(autouse=True)
def own_threads_only(monkeypatch):
    """The look for code that may run while idle reads every thread of this process: only
    the ones these tests start count (earlier tests leave threads of their own, such as
    jupyter_client's channel shutdown loop)."""
    look = blockers.idle_code
    monkeypatch.setattr(blockers, "idle_code", lambda *a: [r for r in look(*a) if USER_THREAD in r])


class Allocator:
    """The allocator's figures and its gate (``native/gate.c``), the gate's modes recorded."""

    holds_every_call = True

    def __init__(self, **bytes_):
        self.bytes = bytes_
        self.gate_modes: list[int] = []
        self._fd = os.eventfd(0)

    def figures(self) -> Figures:
        return Figures(**{name: self.bytes.get(name, 0) for name in FIELDS})

    def wanted_fd(self) -> int:
        return self._fd

    def gate_close(self, mode: int, timeout: float = 10.0) -> None:
        self.gate_modes.append(mode)

    def gate_set(self, mode: int) -> None:
        self.gate_modes.append(mode)

    def gate_open(self) -> None:
        self.gate_modes.append(0)

    def gate_fail(self, why: str, code: int = 2) -> None:
        self.gate_modes.append(-1)

    def machinery(self):
        return contextlib.nullcontext()


class Engine:
    state = "active"

    def __init__(self):
        self.pauses = 0

    def pause(self):
        self.pauses += 1
        return None


def control(children=None, **bytes_) -> tuple[PauseControl, Engine]:
    pc = PauseControl(VGPUKernel(), lambda: None, lambda: False, gpu_processes=lambda: dict(children or {}))
    engine, allocator = Engine(), Allocator(**bytes_)
    pc._allocator = lambda: allocator
    pc._on_gpu = lambda: True
    pc._engine = lambda: engine
    return pc, engine


def test_shared_memory_stays_and_the_rest_is_paused():
    pc, engine = control(own=4 * GiB, exported=256 << 20)
    reasons = pc.blockers()
    assert reasons == [
        "256.00 MiB of its GPU memory is shared with another process (CUDA IPC, e.g. torch.multiprocessing)"
    ]
    assert pc.pauses_partly(reasons)
    pc.take_off()
    assert engine.pauses == 1
    assert pc.state == "paused"
    assert pc._allocator().gate_modes == [1]  # every thread's GPU calls held from the pause on
    said = pc.stats()["not_pausable"]
    assert "that memory stays on the GPU and the rest of this kernel's is paused" in said
    assert "CUDA IPC" in said


def test_a_kernel_paused_in_part_is_never_suspended():
    """The driver checkpoints a process that shares memory through CUDA IPC and then
    refuses to restore it: the arbiter's suspend of the paused kernel is refused."""
    pc, _ = control(own=GiB, imported=64 << 20)
    pc.pause()
    assert pc.state == "paused"
    with pytest.raises(g.Refused, match="cannot bring back a process that shares GPU memory"):
        pc.prepare_suspend()
    assert pc.state == "paused"


def test_a_whole_pause_leaves_nothing_held_back():
    pc, engine = control(own=GiB)
    assert pc.blockers() == []
    pc.take_off()
    assert (engine.pauses, pc.state) == (1, "paused")
    assert pc._held_back() == []


def test_code_that_may_run_while_idle_no_longer_keeps_a_sharing_kernel_on_the_gpu():
    """A thread of the user's that may run while the kernel is idle is no reason to keep
    the kernel on the card (its GPU calls wait while the kernel is away and bring it
    back: the allocator's gate): the sharing kernel is paused in part, and the thread is
    named as code that runs between cells."""
    pc, engine = control(own=GiB, exported=GiB)
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name=USER_THREAD, daemon=True)
    worker.start()
    try:
        reasons = pc.blockers()
        assert not any("while the kernel is idle" in r for r in reasons), reasons
        assert any(USER_THREAD in r for r in pc.idle_code())
        assert pc.pauses_partly(reasons)
        pc.take_off()
        assert (engine.pauses, pc.state) == (1, "paused")
    finally:
        stop.set()
        worker.join()


def test_memory_the_allocator_does_not_know_is_not_paused_around(monkeypatch):
    """PyTorch reserving more than the allocator's figures make the engine refuse; a
    kernel that also shares memory is then neither paused in part nor suspended."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 3 * GiB)
    pc, engine = control(own=GiB, exported=GiB)
    pc._torch = lambda: torch
    reasons = pc.blockers()
    assert any("does not cover" in r for r in reasons), reasons
    assert not pc.pauses_partly(reasons)
    with pytest.raises(g.Refused, match="stays on the GPU"):
        pc.pause()
    assert engine.pauses == 0


def test_without_shared_or_managed_memory_a_child_on_the_gpu_means_a_suspend():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        pc, engine = control(children={child.pid: GiB}, own=GiB)
        reasons = pc.blockers()
        assert any(f"process {child.pid}" in r for r in reasons), reasons
        assert not pc.pauses_partly(reasons)  # the driver can take the kernel and its child
        with pytest.raises(g.Refused):
            pc.pause()
        # with memory shared too, the child keeps its own and the kernel is paused in part
        pc, engine = control(children={child.pid: GiB}, own=GiB, exported=GiB)
        assert pc.pauses_partly(pc.blockers())
        pc.pause()
        assert engine.pauses == 1
    finally:
        child.kill()
        child.wait()


def test_chaos_suspend_pauses_in_part_what_the_driver_cannot_suspend():
    pc, engine = control(own=GiB, managed=64 << 20)
    pc.config.chaos = "suspend"
    pc.after("execute_request")
    assert (engine.pauses, pc.state, pc.last_error) == (1, "paused", None)
    assert "the driver can neither pause nor suspend managed memory" in pc.stats()["not_pausable"]
