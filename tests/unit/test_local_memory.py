"""A pause gives back the CUDA context's local memory and a resume takes it back first
(:mod:`jupyter_vgpu.kernel.pause.local_memory`), over a stand-in for the driver's few
calls that keeps the driver's rules: the local memory is the stack limit times the
threads the card holds, reallocated by ``cuCtxSetLimit`` at once, refused for want of room
(``CUDA_ERROR_OUT_OF_MEMORY``) with nothing changed, and every call needs a context
current. What the real driver does is ``tests/gpu/test_local_memory_gpu.py``'s."""

import enum
import os
import types

import numpy as np
import pytest

from jupyter_vgpu.kernel.pause import vmm
from jupyter_vgpu.kernel.pause.local_memory import LocalMemory

from .host_units import array, host_allocator

MiB = 1 << 20
SMS, PER_SM = 132, 2048  # an H100's SMs and threads per SM
THREADS = SMS * PER_SM


class Driver:
    """The calls of ``cuda.bindings.driver`` that :class:`LocalMemory` makes, over one
    card with ``free`` bytes beside its context's local memory (``stack`` bytes a thread;
    the driver takes nothing under ``smallest``, and refuses 0 where ``refuse_zero``)."""

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
        CUDA_ERROR_OUT_OF_MEMORY = 2
        CUDA_ERROR_INVALID_CONTEXT = 201

    class CUlimit(enum.IntEnum):
        CU_LIMIT_STACK_SIZE = 0

    class CUdevice_attribute(enum.IntEnum):
        CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
        CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR = 39

    def __init__(
        self,
        stack: int = 1024,
        smallest: int = 16,
        refuse_zero: bool = True,
        free: int = 80 << 30,
        frames: int = 0,
    ):
        self.stack, self.smallest, self.refuse_zero, self.free = stack, smallest, refuse_zero, free
        #: local memory a thread holds past the stack limit, grown by kernels whose frames
        #: need it; a change of the limit frees it, and only such a kernel's launch grows it
        self.frames = frames
        self.current: list[str] = []
        self.retained = 0

    ok = CUresult.CUDA_SUCCESS

    def cuDeviceGet(self, ordinal):
        return self.ok, ordinal

    def cuDeviceGetAttribute(self, which, device):
        return self.ok, {16: SMS, 39: PER_SM}[int(which)]

    def cuDevicePrimaryCtxRetain(self, device):
        self.retained += 1
        return self.ok, f"primary context of device {device}"

    def cuDevicePrimaryCtxRelease(self, device):
        self.retained -= 1
        return (self.ok,)

    def cuCtxPushCurrent(self, ctx):
        self.current.append(ctx)
        return (self.ok,)

    def cuCtxPopCurrent(self):
        return self.ok, self.current.pop()

    def cuCtxGetLimit(self, limit):
        if not self.current:
            return self.CUresult.CUDA_ERROR_INVALID_CONTEXT, 0
        return self.ok, self.stack

    def cuCtxSetLimit(self, limit, value):
        if not self.current:
            return (self.CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        if value == 0 and self.refuse_zero:
            return (self.CUresult.CUDA_ERROR_INVALID_VALUE,)
        value = max(value, self.smallest)
        grows = (value - self.stack) * THREADS
        if grows > self.free:
            return (self.CUresult.CUDA_ERROR_OUT_OF_MEMORY,)
        self.free -= grows - self.frames * THREADS
        self.stack, self.frames = value, 0
        return (self.ok,)

    def held(self) -> int:
        """The process's local memory on the card, bytes (NVML's figure, less the rest)."""
        return (self.stack + self.frames) * THREADS


def test_a_pause_gives_back_the_local_memory_past_the_smallest_stack_and_a_resume_takes_it_back():
    driver = Driver(stack=1024, smallest=16, free=1 << 30)
    local = LocalMemory(0, driver=driver)
    given = local.give_back()
    assert given == (1024 - 16) * THREADS  # 261 MiB of an H100's context
    assert driver.stack == 16
    assert driver.free == (1 << 30) + given
    assert local.owed == given
    local.take_back()
    assert driver.stack == 1024
    assert driver.free == 1 << 30
    assert local.owed == 0
    assert driver.current == [], "each call in the primary context, popped after"
    assert driver.retained == 0, "and let go after"


def test_a_stack_a_kernel_grew_comes_back_at_its_grown_size():
    driver = Driver(stack=8192, smallest=16, refuse_zero=False)
    local = LocalMemory(0, driver=driver)
    assert local.give_back() == (8192 - 16) * THREADS
    local.take_back()
    assert driver.stack == 8192


def test_local_memory_a_kernel_grew_past_the_stack_limit_is_counted_as_given_back_from_nvml():
    # a sort's frames held 225 bytes a thread past the 1 KiB limit: the limit's fall frees
    # them too (on an H200: 322 MiB where the limit's fall counts 264 MiB)
    driver = Driver(stack=1024, smallest=16, frames=225, free=1 << 30)
    local = LocalMemory(0, driver=driver, held=driver.held)
    given = local.give_back()
    assert given == (1024 + 225 - 16) * THREADS
    assert driver.free == (1 << 30) + given
    assert local.owed == given, "what a resume asks room for"
    local.take_back()
    assert driver.stack == 1024, "the limit as it was; the frames grow at such a kernel's launch"
    assert local.owed == 0


def test_where_nvml_cannot_say_the_limits_fall_is_counted():
    driver = Driver(stack=1024, smallest=16, frames=225)
    local = LocalMemory(0, driver=driver, held=lambda: None)
    assert local.give_back() == (1024 - 16) * THREADS


@pytest.mark.parametrize(
    "raw",
    [bytes(range(0xF0, 0x100)), [b - 256 if b > 127 else b for b in range(0xF0, 0x100)]],
    ids=["bytes", "signed chars"],
)
def test_by_default_the_process_bytes_are_nvmls_for_the_cards_uuid(monkeypatch, raw):
    from jupyter_vgpu import nvml

    asked = []

    def process_memory(uuid):
        asked.append(uuid)
        return {os.getpid(): 5 * MiB}

    monkeypatch.setattr(nvml, "process_memory", process_memory)
    driver = Driver()
    uuids = []

    def uuid_of(dev):
        uuids.append(dev)
        return driver.ok, types.SimpleNamespace(bytes=raw)

    driver.cuDeviceGetUuid = uuid_of
    local = LocalMemory(0, driver=driver)
    assert local._held() == 5 * MiB
    assert local._held() == 5 * MiB
    assert asked == ["GPU-f0f1f2f3-f4f5-f6f7-f8f9-fafbfcfdfeff"] * 2
    assert len(uuids) == 1, "the card's UUID asked of the driver once"
    monkeypatch.setattr(nvml, "process_memory", lambda uuid: 1 / 0)
    assert local._held() is None, "a figure, never a failure"


def test_a_card_without_room_refuses_the_take_back_and_nothing_changes():
    driver = Driver(stack=1024)
    local = LocalMemory(0, driver=driver)
    given = local.give_back()
    driver.free = given - 1  # another kernel took the room meanwhile
    with pytest.raises(vmm.DeviceFull, match="local memory needs"):
        local.take_back()
    assert driver.stack == 16, "still given back"
    assert local.owed == given, "and still owed"
    driver.free = given
    local.take_back()
    assert driver.stack == 1024
    assert local.owed == 0


def test_nothing_is_given_back_where_the_stack_is_at_its_smallest_already():
    driver = Driver(stack=16)
    local = LocalMemory(0, driver=driver)
    assert local.give_back() == 0
    assert local.owed == 0
    local.take_back()
    assert driver.stack == 16


def test_a_second_give_back_before_a_take_back_changes_nothing():
    driver = Driver(stack=1024)
    local = LocalMemory(0, driver=driver)
    given = local.give_back()
    assert local.give_back() == given
    local.take_back()
    assert driver.stack == 1024, "back to the limit before the first"


# -- in the pause engine, on the allocator's host stand-in ---------------------------


@pytest.fixture(scope="module")
def allocator():
    pytest.importorskip("torch", reason="needs PyTorch (scripts/install brings its CPU build)")
    return host_allocator()


class RefusingMap:
    """The process's allocator, with no room to map units again while ``full``."""

    def __init__(self, allocator):
        self._allocator, self.full = allocator, False

    def map_many(self, ptrs) -> None:
        if self.full:
            raise vmm.DeviceFull(2, "no room, for the test")
        self._allocator.map_many(ptrs)

    def __getattr__(self, name):
        return getattr(self._allocator, name)


@pytest.fixture
def paused(allocator):
    """An engine holding one 6 MiB segment of random bytes, its local memory given back
    by the driver's stand-in: ``(engine, driver, ptr, data, allocator wrapper)``."""
    import torch

    from jupyter_vgpu.kernel.pause.engine import PauseEngine

    ptr = allocator.malloc(6 * MiB)
    data = np.random.default_rng(5).integers(0, 256, 6 * MiB, dtype=np.uint8)
    array(ptr, 6 * MiB)[:] = data
    wrapper = RefusingMap(allocator)
    engine = PauseEngine(torch, wrapper, None, threads=2)
    driver = Driver(stack=1024)
    engine.local = LocalMemory(0, driver=driver)
    outcome = engine.pause()
    yield engine, driver, ptr, data, wrapper, outcome
    engine.close()
    allocator.free(ptr)


def test_the_pause_counts_the_local_memory_in_what_a_resume_needs(paused):
    engine, driver, _, _, _, outcome = paused
    local = (1024 - 16) * THREADS
    assert driver.stack == 16
    assert engine.paused_bytes == 6 * MiB + local
    assert engine.room_needed() >= 6 * MiB + local
    assert outcome.segment_bytes == 6 * MiB + local, "released: the segment and the local memory"


def test_a_resume_with_no_room_for_the_local_memory_stays_paused_with_its_bytes(paused):
    engine, driver, ptr, data, _, _ = paused
    driver.free = 0
    with pytest.raises(vmm.DeviceFull, match="local memory"):
        engine.resume()
    assert engine.state == "paused"
    assert driver.stack == 16
    assert not next(s for s in engine.vmm.segments() if s.ptr == ptr).mapped, "nothing mapped"
    driver.free = 80 << 30
    outcome = engine.resume()
    assert engine.state == "active"
    assert driver.stack == 1024
    assert np.array_equal(array(ptr, 6 * MiB), data)
    assert outcome.segment_bytes == 6 * MiB + (1024 - 16) * THREADS


def test_a_resume_refused_room_for_the_units_gives_the_local_memory_back_again(paused):
    engine, driver, ptr, data, wrapper, _ = paused
    wrapper.full = True
    with pytest.raises(vmm.DeviceFull, match="no room"):
        engine.resume()
    assert engine.state == "paused"
    assert driver.stack == 16, "taken back first, given back again: the card as before the resume"
    assert engine.paused_bytes == 6 * MiB + (1024 - 16) * THREADS
    wrapper.full = False
    engine.resume()
    assert driver.stack == 1024
    assert np.array_equal(array(ptr, 6 * MiB), data)


def test_a_driver_that_refuses_the_take_back_otherwise_leaves_the_kernel_paused_with_its_bytes(paused):
    from jupyter_vgpu.kernel.pause.engine import ResumeError

    engine, driver, ptr, data, _, _ = paused
    refuse = driver.cuCtxSetLimit
    driver.cuCtxSetLimit = lambda limit, value: (driver.CUresult.CUDA_ERROR_INVALID_VALUE,)
    with pytest.raises(ResumeError, match="still paused") as failed:
        engine.resume()
    assert engine.state == "paused"
    assert failed.value.paused_bytes == 6 * MiB + (1024 - 16) * THREADS
    driver.cuCtxSetLimit = refuse
    engine.resume()
    assert np.array_equal(array(ptr, 6 * MiB), data)
