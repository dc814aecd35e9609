"""The arbiter's restore decision, with a recording stand-in for the driver's checkpoint
(no GPU here; the real driver ran these paths on the H100: tests/gpu/test_coverage.py,
tests/faults/test_gpu_faults.py): a kernel it suspended is restored with its footprint
as the room the restore needs; one only the kernel's word calls suspended is asked
about first, and left alone where the driver holds nothing; a restore NVML has no room
for is a wait, not a failure."""

import asyncio

from jupyter_vgpu.node import books
from jupyter_vgpu.node.app import ArbiterApp
from jupyter_vgpu.node.arbiter import Arbiter
from jupyter_vgpu.node.checkpoint import CheckpointError, NoRoom
from jupyter_vgpu.slice import Slice

GiB = 2**30
SLICE = Slice("GPU-real-0", 0, "a card", 80 * GiB, 40 * GiB, 100)


class Driver:
    """What the arbiter asks of :mod:`jupyter_vgpu.node.checkpoint`, recorded."""

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


def restore(driver: Driver, **fields):
    kernel = books.Kernel(4242, books.Server(4242, "ada", "", SLICE), state=books.SUSPENDED, **fields)
    arbiter = Arbiter(ArbiterApp(), checkpoint=driver)
    return asyncio.run(arbiter._restore(kernel)), kernel


def test_a_kernel_the_arbiter_suspended_is_restored_with_its_footprint_as_the_room_needed():
    driver = Driver()
    (ok, why), kernel = restore(driver, group=[4243, 4242], checkpoint_bytes=8 * GiB)
    assert (ok, why) == (True, "")
    assert driver.calls == [("restore", [4243, 4242], {"GPU-real-0": 8 * GiB})]
    assert kernel.group == []
    assert kernel.checkpoint_bytes == 0


def test_a_kernel_only_its_word_calls_suspended_is_looked_up_and_restored_if_the_driver_holds_it():
    driver = Driver(where="checkpointed")
    (ok, _), _ = restore(driver)
    assert ok
    assert [c[0] for c in driver.calls] == ["state", "restore"]


def test_a_kernel_without_a_cuda_context_is_left_alone():
    for where in (None, "running"):
        driver = Driver(where=where)
        (ok, why), _ = restore(driver)
        assert (ok, why) == (True, "")
        assert [c[0] for c in driver.calls] == ["state"]


def test_no_room_for_a_restore_is_a_wait_and_the_kernel_stays_suspended():
    driver = Driver(room=False)
    (ok, why), kernel = restore(driver, group=[4242], checkpoint_bytes=8 * GiB)
    assert ok is None
    assert "8.50 GiB" in why
    assert kernel.group == [4242]
    assert kernel.checkpoint_bytes == 8 * GiB
