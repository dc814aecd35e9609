"""The threads that make a pause's and a resume's driver calls beside the copies: units
are released and mapped in the order given, a caller waits only for what it needs, and
a failure on the thread reaches the caller."""

import threading

import pytest

from jupyter_vgpu.kernel.pause.overlap import Mapper, Releaser

MiB = 1 << 20


def test_the_releaser_releases_in_order_and_hands_a_failure_to_the_pause():
    released = []
    r = Releaser(released.append)
    for unit in range(5):
        r.put(unit)
    r.close()
    assert released == [0, 1, 2, 3, 4]

    def release(unit):
        if unit == 2:
            raise RuntimeError("the driver refused unit 2")
        released.append(unit)

    released.clear()
    r = Releaser(release)
    for unit in range(5):
        r.put(unit)
    with pytest.raises(RuntimeError, match="unit 2"):
        r.close()
    assert released == [0, 1], "nothing is released after a failure: the pause is undone"
    with pytest.raises(RuntimeError, match="unit 2"):
        r.put(6)


def test_the_mapper_maps_a_few_units_a_call_and_a_waiter_waits_for_its_own():
    calls, gate = [], threading.Event()

    def map_many(ptrs):
        if ptrs[0] >= 4:
            gate.wait(10)  # the last units are held back until the test has waited
        calls.append(list(ptrs))

    units = [(i, 20 * MiB) for i in range(6)]
    m = Mapper(map_many, units, chunk_bytes=40 * MiB)
    m.wait(3)  # the first two calls, while the third is held
    assert calls == [[0, 1], [2, 3]]
    gate.set()
    m.wait_all()
    assert calls == [[0, 1], [2, 3], [4, 5]]
    assert m.close() == list(range(6))


def test_a_mapping_that_finds_no_room_stops_and_says_so_to_who_needs_it():
    def map_many(ptrs):
        if 4 in ptrs:
            raise MemoryError("no room for unit 4")

    m = Mapper(map_many, [(i, 20 * MiB) for i in range(6)], chunk_bytes=40 * MiB)
    m.wait(4)  # mapped before the failure
    with pytest.raises(MemoryError, match="unit 4"):
        m.wait(5)
    assert m.close() == [0, 1, 2, 3], "the units mapped, for the resume to release"
