"""The arbiter's restore decision, with a recording stand-in for the driver's checkpoint
(no GPU here; the real driver ran these paths on the H100: tests/gpu/test_coverage.py,
tests/faults/test_gpu_faults.py): a kernel it suspended is restored with its footprint
as the room the restore needs; one only the kernel's word calls suspended is asked
about first, and left alone where the driver holds nothing; a restore NVML has no room
for is a wait, not a failure."""

import asyncio
import os
import signal

import pytest

from jupyter_vgpu.host import procs
from jupyter_vgpu.host.checkpoint import CheckpointError, NoRoom
from jupyter_vgpu.node import books
from jupyter_vgpu.node.app import ArbiterApp
from jupyter_vgpu.node.arbiter import Arbiter
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.waiting import wait_for

from .sleepers import sleeping

GiB = 2**30
SLICE = Slice("GPU-real-0", 0, "a card", 80 * GiB, 40 * GiB, 100)


class Driver:
    """What the arbiter asks of :mod:`jupyter_vgpu.host.checkpoint`, recorded."""

    NoRoom = NoRoom

    def __init__(self, where: str | None = "checkpointed", room: bool = True):
        self.where, self.room, self.calls = where, room, []

    def state(self, pid):
        self.calls.append(("state", pid))
        if self.where is None:
            raise CheckpointError("cuCheckpointProcessGetState failed: no CUDA context")
        return self.where

    def restore(self, pids, need=None):
        self.calls.append(("restore", list(pids), need))
        if not self.room:
            raise NoRoom("the GPU has 1.00 GiB free where the restore needs 8.50 GiB")
        return 0.5


@pytest.fixture
def processes():
    """Two real processes: a kernel and a child of it that held GPU memory."""
    with sleeping(2) as pids:
        yield pids


def restore(driver: Driver, pids: list[int], suspended_by_us: bool = True, **fields):
    kernel_pid = pids[-1]
    kernel = books.Kernel(
        kernel_pid, books.Server(kernel_pid, "ada", "", SLICE), state=books.SUSPENDED, **fields
    )
    kernel.identity = procs.Identity.of(kernel_pid)
    if suspended_by_us:
        kernel.group_ids = [procs.Identity.of(p) for p in pids[:-1]] + [kernel.identity]
        kernel.group = list(pids)
    arbiter = Arbiter(ArbiterApp(), checkpoint=driver)
    return asyncio.run(arbiter.moves.restore(kernel)), kernel


def test_a_kernel_the_arbiter_suspended_is_restored_with_its_footprint_as_the_room_needed(processes):
    driver = Driver()
    (ok, why), kernel = restore(driver, processes, checkpoint_bytes=8 * GiB)
    assert (ok, why) == (True, "")
    assert driver.calls == [("restore", processes, {"GPU-real-0": 8 * GiB})]
    assert kernel.group == []
    assert kernel.checkpoint_bytes == 0


def test_a_kernel_only_its_word_calls_suspended_is_looked_up_and_restored_if_the_driver_holds_it(processes):
    driver = Driver(where="checkpointed")
    (ok, _), _ = restore(driver, processes[-1:], suspended_by_us=False)
    assert ok
    assert [c[0] for c in driver.calls] == ["state", "restore"]


def test_a_kernel_without_a_cuda_context_is_left_alone(processes):
    for where in (None, "running"):
        driver = Driver(where=where)
        (ok, why), _ = restore(driver, processes[-1:], suspended_by_us=False)
        assert (ok, why) == (True, "")
        assert [c[0] for c in driver.calls] == ["state"]


def test_no_room_for_a_restore_is_a_wait_and_the_kernel_stays_suspended(processes):
    driver = Driver(room=False)
    (ok, why), kernel = restore(driver, processes[-1:], checkpoint_bytes=8 * GiB)
    assert ok is None
    assert "8.50 GiB" in why
    assert kernel.group == processes[-1:]
    assert kernel.checkpoint_bytes == 8 * GiB


def test_a_group_whose_process_changed_hands_is_never_handed_to_the_driver(processes):
    """A process suspended with the kernel has ended since (its PID may be another's now):
    the restore is refused before any call of the driver's, whichever process it was."""
    driver = Driver()
    kernel_pid = processes[-1]
    kernel = books.Kernel(kernel_pid, books.Server(kernel_pid, "ada", "", SLICE), state=books.SUSPENDED)
    kernel.identity = procs.Identity.of(kernel_pid)
    child = procs.Identity.of(processes[0])
    kernel.group_ids, kernel.group = [child, kernel.identity], list(processes)
    os.kill(processes[0], signal.SIGKILL)
    wait_for(lambda: not child.current(), 10, "the child to end")
    ok, why = asyncio.run(Arbiter(ArbiterApp(), checkpoint=driver).moves.restore(kernel))
    assert ok is False
    assert f"process {processes[0]} has ended" in why
    assert driver.calls == []
