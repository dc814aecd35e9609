"""The kernel's side of a release (the arbiter's ``release``): an idle kernel gives back
its allocator's cached free blocks and says how much, under its gate, so that no cell
starts and no pause begins meanwhile; anything but idle refuses, and a kernel that never
initialized CUDA gives nothing. PyTorch's CUDA allocator is not here: a stand-in keeps
its figures (``memory_reserved``, ``memory_stats``, what ``empty_cache`` frees: whole free
segments only); on a real card, ``tests/gpu/test_release_gpu.py``."""

from __future__ import annotations

import threading
import types

import pytest

from jupyter_vgpu.kernel import gate as g
from jupyter_vgpu.kernel.config import VGPUKernel
from jupyter_vgpu.kernel.pausing import PauseControl

GiB = 2**30


class Cuda:
    """``torch.cuda`` as far as a release reads it: two devices' allocators."""

    def __init__(self, reserved: list[int], allocated: list[int], initialized: bool = True, split=None):
        self.reserved, self.allocated, self.initialized = reserved, allocated, initialized
        # free bytes inside segments that also hold a live tensor: empty_cache keeps them
        self.split = split or [0] * len(reserved)
        self.emptied = 0
        self.during = None  # called inside empty_cache, where a test looks at the gate

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return len(self.reserved)

    def memory_reserved(self, device: int) -> int:
        return self.reserved[device]

    def memory_stats(self, device: int) -> dict:
        return {
            "reserved_bytes.all.current": self.reserved[device],
            "active_bytes.all.current": self.allocated[device],
            "inactive_split_bytes.all.current": self.split[device],
        }

    def empty_cache(self) -> None:
        if self.during is not None:
            self.during()
        self.emptied += 1
        self.reserved = [a + s for a, s in zip(self.allocated, self.split, strict=True)]


def control(cuda: Cuda) -> PauseControl:
    torch = types.SimpleNamespace(cuda=cuda)
    return PauseControl(VGPUKernel(), lambda: torch, lambda: False)


def test_an_idle_kernel_gives_back_its_cached_blocks_and_says_how_much():
    cuda = Cuda([17 * GiB, 3 * GiB], [2 * GiB, 3 * GiB])
    pc = control(cuda)
    assert pc.cached_bytes() == 15 * GiB  # the figure its state message carries
    assert pc.release_cache() == 15 * GiB
    assert cuda.emptied == 1
    assert pc.cached_bytes() == 0
    assert pc.state == g.IDLE  # it stays on the card, idle


def test_it_says_only_what_empty_cache_can_give_back_not_the_free_bytes_beside_live_tensors():
    # an MLP step on an H200: 3.19 GiB reserved past the allocated, 2.0 GiB given back
    # (benchmarks/results/gpu-tests-h200x2.log); the rest shares segments with tensors
    cuda = Cuda([6 * GiB], [3 * GiB], split=[GiB])
    pc = control(cuda)
    assert pc.cached_bytes() == 2 * GiB
    assert pc.release_cache() == 2 * GiB
    assert pc.cached_bytes() == 0  # asked again, it would say it has nothing to give


@pytest.mark.parametrize("state", [g.BUSY, g.PAUSED, g.SUSPENDED])
def test_a_kernel_that_is_not_idle_refuses_and_keeps_its_cache(state):
    cuda = Cuda([17 * GiB], [2 * GiB])
    pc = control(cuda)
    pc.gate.state = state
    with pytest.raises(g.Refused, match=str(state)):
        pc.release_cache()
    assert cuda.emptied == 0


def test_a_kernel_that_never_initialized_cuda_gives_nothing_and_calls_nothing():
    cuda = Cuda([0], [0], initialized=False)
    pc = control(cuda)
    assert pc.cached_bytes() is None
    assert pc.release_cache() == 0
    assert cuda.emptied == 0


def test_no_cell_starts_while_the_cache_is_given_back():
    cuda = Cuda([17 * GiB], [2 * GiB])
    pc = control(cuda)
    entered = threading.Event()
    started = threading.Event()

    def cell():
        pc.gate.enter()  # a handler: waits on the gate until the release is done
        entered.set()
        pc.gate.leave()

    def during():
        thread = threading.Thread(target=cell)
        thread.start()
        started.set()
        # the handler cannot be admitted while the release holds the gate
        assert not entered.wait(0.3), "a cell started while the cache was given back"

    pc.gate._resume = lambda prior, cell=False: None  # an idle kernel's admission: nothing to bring back
    cuda.during = during
    assert pc.release_cache() == 15 * GiB
    assert started.is_set()
    assert entered.wait(10), "the cell was admitted once the release was done"
