"""The GPU path's pinned slabs: handed out front to back, kept warm across pauses (and
counted while they are), let go when asked. Pinning itself needs a GPU; here a slab is
a plain uint8 tensor made by the same call the arena would make, counted as it is made."""

import pytest

pytest.importorskip("torch", reason="needs PyTorch (scripts/install brings its CPU build)")

import torch

from jupyter_vgpu.kernel.codec.pinned_arena import PinnedArena

MiB = 2**20


class Pinning:
    """Stands in for ``torch.empty(n, pin_memory=True)``: counts the slabs made."""

    def __init__(self):
        self.made: list[int] = []

    def __call__(self, nbytes: int):
        self.made.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


def test_slabs_are_handed_out_front_to_back_and_aligned():
    pin = Pinning()
    arena = PinnedArena(torch, slab_bytes=4 * MiB, pin=pin)
    assert arena.reserve(3 * MiB) == (0, 0)
    assert arena.reserve(100) == (0, 3 * MiB)
    assert arena.reserve(2 * MiB) == (1, 0)  # the first slab has not 2 MiB left
    assert arena.reserve(9 * MiB) == (2, 0)  # larger than a slab: a slab of its own
    assert pin.made == [4 * MiB, 4 * MiB, 9 * MiB]
    assert arena.held_bytes == 17 * MiB
    slab, start = arena.reserve(5)
    assert (arena.address(slab, start) - arena.address(slab, 0)) % 16 == 0


def test_a_second_pause_takes_the_warm_slabs_instead_of_pinning_again():
    pin = Pinning()
    arena = PinnedArena(torch, slab_bytes=4 * MiB, pin=pin)
    for _ in range(3):
        arena.reserve(4 * MiB)
    arena.clear()  # resumed: nothing held for data, the slabs kept for the next pause
    assert arena.held_bytes == arena.warm_bytes == 12 * MiB, "kept, and counted"
    for _ in range(4):
        arena.reserve(4 * MiB)
    assert pin.made == [4 * MiB] * 4, "three warm slabs reused, one pinned"
    assert arena.warm_bytes == 0
    assert arena.held_bytes == 16 * MiB
    arena.clear()
    arena.reserve(9 * MiB)  # no warm slab is large enough: pinned anew
    assert pin.made[-1] == 9 * MiB


def test_trim_lets_warm_slabs_go_and_keeps_the_ones_holding_data():
    pin = Pinning()
    arena = PinnedArena(torch, slab_bytes=4 * MiB, pin=pin)
    arena.reserve(4 * MiB)
    arena.reserve(4 * MiB)
    arena.clear()
    arena.reserve(1 * MiB)  # a paused kernel's data in one of them
    assert arena.trim() == 4 * MiB
    assert arena.held_bytes == 4 * MiB
    assert arena.warm_bytes == 0
    assert arena.trim() == 0


def test_an_engine_counts_its_warm_slabs_as_held_and_lets_them_go_on_trim():
    from jupyter_vgpu.kernel.pause import vmm
    from jupyter_vgpu.kernel.pause.engine import PauseEngine

    allocator = vmm.load()
    if allocator.backend == 0:
        allocator.init(vmm.HOST)
    engine = PauseEngine(torch, allocator, None, threads=1)
    try:
        engine.arena = PinnedArena(torch, slab_bytes=4 * MiB, pin=Pinning())
        engine.arena.reserve(4 * MiB)
        engine.arena.clear()  # as after a resume of the GPU path
        assert engine.host_held() == 4 * MiB, "what the arbiter counts against the host budget"
        assert engine.trim() == 4 * MiB
        assert engine.host_held() == 0
    finally:
        engine.close()


def test_prepare_pins_warm_slabs_ahead_that_the_next_pause_takes_without_pinning():
    pin = Pinning()
    arena = PinnedArena(torch, slab_bytes=4 * MiB, pin=pin)
    assert arena.prepare(10 * MiB) == 12 * MiB, "whole slabs until 10 MiB are warm"
    assert arena.held_bytes == arena.warm_bytes == 12 * MiB, "counted as held from the start"
    assert arena.prepare(10 * MiB) == 0, "already warm enough"
    for _ in range(3):
        arena.reserve(4 * MiB)  # the pause
    assert pin.made == [4 * MiB] * 3, "the pause pinned nothing of its own"
    assert arena.warm_bytes == 0


def test_prepare_stops_before_the_next_slab_when_told_to():
    pin = Pinning()
    arena = PinnedArena(torch, slab_bytes=4 * MiB, pin=pin)
    answers = iter([True, True, False, True])
    assert arena.prepare(64 * MiB, lambda: next(answers)) == 8 * MiB
    assert pin.made == [4 * MiB, 4 * MiB]
    assert arena.trim() == 8 * MiB, "what it pinned is warm, and let go on trim"
    assert arena.held_bytes == 0


def test_a_pause_and_prepare_in_two_threads_count_every_slab_once():
    import threading

    pin = Pinning()
    arena = PinnedArena(torch, slab_bytes=1 * MiB, pin=pin)
    ahead = threading.Thread(target=arena.prepare, args=(64 * MiB,))
    ahead.start()
    for _ in range(64):
        arena.reserve(1 * MiB)
    ahead.join()
    assert arena.held_bytes == sum(pin.made), "every slab pinned is counted once"
    assert arena.held_bytes == sum(s.numel() for s in arena.slabs) + arena.warm_bytes


def test_a_slab_whose_pieces_moved_goes_and_adopted_memory_is_never_kept():
    pin = Pinning()
    arena = PinnedArena(torch, slab_bytes=4 * MiB, pin=pin)
    arena.reserve(3 * MiB)
    arena.reserve(3 * MiB)  # slab 1
    outside = torch.zeros(MiB, dtype=torch.uint8)  # a mapping of a shared piece, say
    adopted = arena.adopt(outside.data_ptr())
    assert arena.address(adopted, 16) == outside.data_ptr() + 16
    assert arena.held_bytes == 8 * MiB  # adopted memory is not the arena's
    assert arena.release(0) == 4 * MiB
    assert (arena.release(0), arena.release(adopted)) == (0, 0)  # once; and never what it adopted
    assert arena.held_bytes == 4 * MiB
    assert arena.reserve(MiB)[0] == adopted + 1  # a new slab: never into adopted memory
    arena.clear()  # slab 1 and the last one go warm; the released and adopted ones are forgotten
    assert (arena.warm_bytes, arena.held_bytes) == (8 * MiB, 8 * MiB)
    assert arena.trim() == 8 * MiB
