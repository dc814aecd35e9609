"""The pause engine on the allocator's host stand-in: every live byte leaves and comes
back bit-exact at the same addresses, the memory really goes back to the system, and
failures leave nothing half done."""

import dataclasses
import itertools

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs PyTorch (scripts/install brings its CPU build)")

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_vgpu.kernel.pause import vmm
from jupyter_vgpu.kernel.pause.engine import PauseEngine, PauseError, ResumeError
from jupyter_vgpu.kernel.pause.ranges import live_ranges, spans
from jupyter_vgpu.kernel.pause.states import PauseState
from jupyter_vgpu.kernel.pause.workarea import WorkArea

from .host_units import array, host_allocator

MiB = 1 << 20
rng = np.random.default_rng(11)


@pytest.fixture(scope="module")
def allocator():
    return host_allocator()


@pytest.fixture
def segments(allocator):
    """Three segments: bf16-like weights, random bytes, zeros; freed afterwards."""
    made = []
    for fill in ("weights", "random", "zeros"):
        ptr = allocator.malloc(6 * MiB)
        data = array(ptr, 6 * MiB)
        if fill == "weights":
            f32 = (rng.standard_normal(3 * MiB, dtype=np.float32) * 0.02).view(np.uint32)
            data[:] = (f32 >> 16).astype(np.uint16).view(np.uint8)
        elif fill == "random":
            data[:] = rng.integers(0, 256, data.size, dtype=np.uint8)
        else:
            data[:] = 0
        made.append((ptr, data.copy()))
    yield made
    for ptr, _ in made:
        allocator.free(ptr)


def resident(ptr: int, nbytes: int) -> int:
    """Bytes of [ptr, ptr + nbytes) backed by memory, from /proc/self/smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < ptr + nbytes and ptr < hi
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


@pytest.fixture
def engine(allocator):
    e = PauseEngine(torch, allocator, None, threads=2)
    yield e
    e.close()


def test_pause_releases_the_memory_and_resume_brings_every_byte_back(engine, allocator, segments):
    assert all(resident(ptr, data.size) >= data.size for ptr, data in segments)
    out = engine.pause()
    assert engine.state is PauseState.PAUSED
    assert allocator.mapped_bytes == 0
    assert out.segment_bytes == out.live_bytes == 18 * MiB
    assert out.host_bytes < 0.75 * out.live_bytes  # weights compress, zeros cost nothing
    assert all(resident(ptr, data.size) == 0 for ptr, data in segments)  # back to the system
    assert engine.stats()["state"] == "paused"
    back = engine.resume()
    assert engine.state is PauseState.ACTIVE
    assert back.live_bytes == out.live_bytes
    for ptr, data in segments:
        assert np.array_equal(array(ptr, data.size), data)
    assert engine.stats()["last_resume_disk"] is None, "nothing came back from the disk tier"


def test_a_damaged_chunk_keeps_the_kernel_paused_with_its_host_copy(engine, segments):
    engine.pause()
    store = engine.store
    compressed = [
        (k, e.packed)
        for k, e in store._entries.items()
        if any(c.kind.name == "ZSTD" for c in e.packed.chunks)
    ]
    key, packed = compressed[0]
    chunk = next(c for c in packed.chunks if c.kind.name == "ZSTD")
    bad = bytearray(chunk.payload)
    bad[len(bad) // 2] ^= 0xFF
    chunks = tuple(dataclasses.replace(c, payload=bytes(bad)) if c is chunk else c for c in packed.chunks)
    store._entries[key].packed = dataclasses.replace(packed, chunks=chunks)
    with pytest.raises(ResumeError, match="still paused") as e:
        engine.resume()
    assert engine.state == "paused"
    assert e.value.paused_bytes == 18 * MiB, "the device memory a resume still needs"
    assert e.value.host_bytes == engine.last_pause.host_bytes, "every stored byte is kept"
    store._entries[key].packed = packed  # the intact copy
    engine.resume()
    for ptr, data in segments:
        assert np.array_equal(array(ptr, data.size), data)


def test_a_refused_pause_is_undone(allocator, segments):
    small = PauseEngine(torch, allocator, None, host_cap_bytes=MiB, threads=2)
    try:
        with pytest.raises(PauseError, match="undone") as e:
            small.pause()
        assert not e.value.still_paused
        assert small.state == "active"
        assert allocator.mapped_bytes >= 18 * MiB
        for ptr, data in segments:
            assert np.array_equal(array(ptr, data.size), data)
        assert small.store.stats()["host_bytes"] == 0
    finally:
        small.close()


def test_past_the_cap_the_host_path_spills_to_disk_and_reads_back(allocator, segments, tmp_path):
    spilling = PauseEngine(torch, allocator, None, host_cap_bytes=MiB, spill_dir=tmp_path, threads=2)
    try:
        spilling.pause()
        assert spilling.store.stats()["disk_bytes"] > 0
        spilling.resume()
        for ptr, data in segments:
            assert np.array_equal(array(ptr, data.size), data)
    finally:
        spilling.close()


def test_live_ranges_keep_only_blocks_that_hold_data():
    base = 1 << 40
    snapshot = [
        {
            "address": base,
            "total_size": 8 * MiB,
            "blocks": [
                {"address": base, "size": MiB, "state": "active_allocated"},
                {"address": base + MiB, "size": MiB, "state": "active_pending_free"},
                {"address": base + 2 * MiB, "size": 4 * MiB, "state": "inactive"},
                {"address": base + 6 * MiB, "size": 2 * MiB, "state": "active_allocated"},
            ],
        },
        {
            "address": base + 8 * MiB,
            "total_size": 2 * MiB,
            "blocks": [{"size": 2 * MiB, "state": "inactive"}],
        },
    ]
    unknown = base + 64 * MiB
    got = live_ranges(snapshot, [(base, 8 * MiB), (base + 8 * MiB, 2 * MiB), (unknown, 4 * MiB)])
    assert got[base] == [(0, 2 * MiB), (6 * MiB, 2 * MiB)]
    assert got[base + 8 * MiB] == []
    assert got[unknown] == [(0, 4 * MiB)]  # another library's memory: live as a whole
    assert live_ranges(None, [(base, MiB)]) == {base: [(0, MiB)]}


def test_spans_join_live_ranges_of_units_side_by_side():
    base = 1 << 40
    a, b, c, d = base, base + 2 * MiB, base + 4 * MiB, base + 64 * MiB  # d lies apart
    units = [(c, 2 * MiB, 0), (a, 2 * MiB, 0), (b, 2 * MiB, 0), (d, 2 * MiB, 0)]
    live = {a: [(MiB, MiB)], b: [(0, 2 * MiB)], c: [(0, MiB // 2), (MiB, MiB)], d: [(0, 2 * MiB)]}
    assert spans(units, live) == [
        (a, MiB, 3 * MiB + MiB // 2, (a, b, c)),  # a's tail, all of b, c's head: one span
        (c, MiB, MiB, (c,)),  # after a gap of free bytes
        (d, 0, 2 * MiB, (d,)),  # not adjacent
    ]
    # a unit of another device starts a span of its own, and a unit with nothing live
    # in it breaks the run
    assert spans([(a, 2 * MiB, 0), (b, 2 * MiB, 1)], {a: [(0, 2 * MiB)], b: [(0, 2 * MiB)]}) == [
        (a, 0, 2 * MiB, (a,)),
        (b, 0, 2 * MiB, (b,)),
    ]
    units = [(a, 2 * MiB, 0), (b, 2 * MiB, 0), (c, 2 * MiB, 0)]
    assert spans(units, {a: [(0, 2 * MiB)], b: [], c: [(0, 2 * MiB)]}) == [
        (a, 0, 2 * MiB, (a,)),
        (c, 0, 2 * MiB, (c,)),
    ]


def _pieces(joined, grid: int) -> set[tuple[int, int, int]]:
    """The pieces the codec cuts ``joined`` into (each span from its start, ``grid`` bytes
    at most), as ``(unit, offset, length)``, the offset from the unit they begin in."""
    return {
        (unit, off + at, min(grid, length - at))
        for unit, off, length, _ in joined
        for at in range(0, length, grid)
    }


def test_on_a_grid_the_same_bytes_give_the_same_pieces_whatever_lives_around_them():
    base, grid = 1 << 40, 8 * MiB
    u = base
    # one block at 8-9 MiB is live in one kernel and free in the other
    free_there = {u: [(0, 8 * MiB), (9 * MiB, 15 * MiB)]}
    live_there = {u: [(0, 24 * MiB)]}
    units = [(u, 24 * MiB, 0)]
    without = _pieces(spans(units, free_there), grid) & _pieces(spans(units, live_there), grid)
    assert without == {(u, 0, 8 * MiB)}  # spans cut from their starts: every later piece moved
    on_grid = _pieces(spans(units, free_there, grid), grid) & _pieces(spans(units, live_there, grid), grid)
    assert on_grid == {(u, 0, 8 * MiB), (u, 16 * MiB, 8 * MiB)}  # only the piece holding the block differs
    assert spans(units, free_there, grid) == [
        (u, 0, 8 * MiB, (u,)),
        (u, 9 * MiB, 7 * MiB, (u,)),  # the head, up to the next point of the grid
        (u, 16 * MiB, 8 * MiB, (u,)),
    ]


def test_on_a_grid_a_span_runs_into_the_next_unit_only_where_the_grid_does():
    base, grid = 1 << 40, 4 * MiB
    a, b, c = base, base + 6 * MiB, base + 12 * MiB  # side by side, 6 MiB each: off the grid
    live = {a: [(0, 6 * MiB)], b: [(0, 6 * MiB)], c: [(MiB, 5 * MiB)]}
    units = [(a, 6 * MiB, 0), (b, 6 * MiB, 0), (c, 6 * MiB, 0)]
    assert spans(units, live) == [(a, 0, 12 * MiB, (a, b)), (c, MiB, 5 * MiB, (c,))]
    assert spans(units, live, grid) == [
        (a, 0, 6 * MiB, (a,)),
        (b, 0, 6 * MiB, (b,)),
        (c, MiB, 3 * MiB, (c,)),
        (c, 4 * MiB, 2 * MiB, (c,)),
    ]
    # units of 8 MiB: the grid runs on, so does the span; a head that ends with its unit
    # leaves the rest to the next
    a, b, c = base, base + 8 * MiB, base + 16 * MiB
    units = [(a, 8 * MiB, 0), (b, 8 * MiB, 0), (c, 8 * MiB, 0)]
    live = {a: [(2 * MiB, 6 * MiB)], b: [(0, 8 * MiB)], c: [(0, MiB)]}
    assert spans(units, live, grid) == [
        (a, 2 * MiB, 2 * MiB, (a,)),
        (a, 4 * MiB, 13 * MiB, (a, b, c)),
    ]
    live = {a: [(5 * MiB, 3 * MiB)], b: [(0, 8 * MiB)], c: []}
    assert spans(units, live, 8 * MiB) == [(a, 5 * MiB, 3 * MiB, (a,)), (b, 0, 8 * MiB, (b,))]


@st.composite
def _layouts(draw):
    """Units of 2 MiB multiples, some side by side, on one or two devices, with live
    ranges at 256 KiB granularity: ``(units, live)`` as :func:`spans` takes them."""
    units, live, at = [], {}, 1 << 40
    for _ in range(draw(st.integers(1, 6))):
        at += draw(st.sampled_from([0, 0, 2 * MiB]))  # side by side, or a gap
        size = draw(st.integers(1, 12)) * 2 * MiB
        cells = size // (MiB // 4)
        edges = draw(st.sampled_from([[], [0], [cells], [0, cells]]))  # live up to its ends
        marks = sorted(set(draw(st.lists(st.integers(0, cells), max_size=6)) + edges))
        runs = [(a, b) for a, b in zip(marks[::2], marks[1::2], strict=False) if b > a]
        units.append((at, size, draw(st.sampled_from([0, 0, 1]))))
        live[at] = [(a * MiB // 4, (b - a) * MiB // 4) for a, b in runs]
        at += size
    return units, live


@settings(max_examples=300, deadline=None)
@given(_layouts(), st.sampled_from([None, 4 * MiB, 8 * MiB]))
def test_spans_cover_every_live_byte_once_and_keep_to_the_grid(layout, grid):
    units, live = layout
    size_of = {ptr: size for ptr, size, _ in units}
    device_of = {ptr: dev for ptr, _, dev in units}
    got = spans(iter(units), live, grid)  # any iterable, as the engine passes a generator
    covered_bytes = []
    for unit, off, length, covered in got:
        assert length > 0
        assert covered[0] == unit
        assert len({device_of[u] for u in covered}) == 1  # one device per span
        for a, b in itertools.pairwise(covered):  # side by side, in order
            assert a + size_of[a] == b
        start = unit + off
        assert unit <= start < unit + size_of[unit]
        assert start + length <= covered[-1] + size_of[covered[-1]]
        assert start + length > covered[-1]  # the last unit it names holds some of it
        covered_bytes.append((start, start + length))
        if grid is not None:
            # on the grid of the unit it starts in, or a head up to the next point
            assert off % grid == 0 or length <= grid - off % grid, (off, length)
            for a in covered[:-1]:  # it runs on past a unit only where the grid does
                assert size_of[a] % grid == 0
    live_bytes = sorted((ptr + o, ptr + o + n) for ptr, runs in live.items() for o, n in runs if n > 0)
    merged = []
    for a, b in sorted(covered_bytes):
        assert not merged or a >= merged[-1][1]  # no byte in two spans
        merged.append((a, b))
    flat = []  # adjacent ranges joined, on both sides, to compare as sets of bytes
    for ranges in (merged, live_bytes):
        out = []
        for a, b in ranges:
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
        flat.append(out)
    assert flat[0] == flat[1]


#: Units of the side-by-side tests: larger than any hole earlier tests leave (their
#: segments are 6 MiB at most), so that mmap places them at its frontier, one below the
#: other (Linux maps top-down), not in those holes.
UNIT = 32 * MiB


def adjacent_units(allocator, count: int, tries: int = 8) -> list[int]:
    """``count`` new segments of :data:`UNIT` bytes lying side by side, lowest address
    first: of ``tries`` made one after the other, a run of ``count`` adjacent ones is kept
    (another thread's mapping may land between two) and the others freed."""
    made = sorted(allocator.malloc(UNIT) for _ in range(tries))
    for i in range(tries - count + 1):
        run = made[i : i + count]
        if all(run[j] + UNIT == run[j + 1] for j in range(count - 1)):
            for ptr in made:
                if ptr not in run:
                    allocator.free(ptr)
            return run
    for ptr in made:
        allocator.free(ptr)
    pytest.skip(f"mmap placed none of {tries} segments side by side on this system")


def test_bytes_of_units_side_by_side_are_stored_as_one_span(allocator):
    units = adjacent_units(allocator, 3)
    data = rng.integers(0, 4, 3 * UNIT, dtype=np.uint8)
    array(units[0], 3 * UNIT)[:] = data  # one buffer across three units
    e = PauseEngine(torch, allocator, None, threads=2)
    try:
        out = e.pause()
        assert out.live_bytes == 3 * UNIT
        ranges = [(r.address, r.length) for p in e._paused for r in p.ranges]
        assert ranges == [(units[0], 3 * UNIT)], ranges
        assert all(resident(ptr, UNIT) == 0 for ptr in units)
        e.resume()
        assert np.array_equal(array(units[0], 3 * UNIT), data)
    finally:
        e.close()
        for ptr in units:
            allocator.free(ptr)


class Refusing:
    """The process's allocator, refusing one unit: to release it (``on="unmap"``, as a
    driver may), or room for it when it is mapped again (``on="map"``; ``refused`` None:
    no more refusals)."""

    def __init__(self, allocator, refused: int | None, on: str = "unmap"):
        self._allocator, self.refused, self.on = allocator, refused, on

    def unmap(self, ptr: int) -> None:
        if self.on == "unmap" and ptr == self.refused:
            raise vmm.VMMError(999, "refused for the test")
        self._allocator.unmap(ptr)

    def map_many(self, ptrs) -> None:
        if self.on == "map" and self.refused in ptrs:
            raise vmm.DeviceFull(2, "no room, for the test")
        self._allocator.map_many(ptrs)

    def __getattr__(self, name):
        return getattr(self._allocator, name)


def test_a_pause_undone_halfway_through_a_span_writes_back_every_unit_it_released(allocator):
    units = adjacent_units(allocator, 3)
    data = rng.integers(0, 256, 3 * UNIT, dtype=np.uint8)
    array(units[0], 3 * UNIT)[:] = data
    e = PauseEngine(torch, Refusing(allocator, units[1]), None, threads=2)
    try:
        with pytest.raises(PauseError, match="undone"):
            e.pause()
        assert e.state == "active"
        assert all(s.mapped for s in allocator.segments() if s.ptr in units)
        assert np.array_equal(array(units[0], 3 * UNIT), data)
        assert e.store.stats()["host_bytes"] == 0, "nothing kept on the host for a pause undone"
    finally:
        e.close()
        for ptr in units:
            allocator.free(ptr)


class RefusingBoth(Refusing):
    """Refuses to release one unit, and, while it does, room to map any unit again."""

    def map_many(self, ptrs) -> None:
        if self.refused is not None:
            raise vmm.DeviceFull(2, "no room, for the test")
        self._allocator.map_many(ptrs)


def test_a_pause_whose_undo_fails_says_it_stays_paused_and_a_resume_brings_every_byte_back(allocator):
    units = adjacent_units(allocator, 3)
    data = rng.integers(0, 256, 3 * UNIT, dtype=np.uint8)
    array(units[0], 3 * UNIT)[:] = data
    refusing = RefusingBoth(allocator, units[1])
    e = PauseEngine(torch, refusing, None, threads=2)
    try:
        with pytest.raises(PauseError, match="so did undoing it") as failed:
            e.pause()
        assert failed.value.still_paused
        assert e.state is PauseState.PAUSED
        assert e.paused_bytes == UNIT, "the unit it released before the refusal"
        refusing.refused = None
        e.resume()
        assert e.state is PauseState.ACTIVE
        assert all(s.mapped for s in allocator.segments() if s.ptr in units)
        assert np.array_equal(array(units[0], 3 * UNIT), data)
        assert e.store.stats()["host_bytes"] == 0
    finally:
        e.close()
        for ptr in units:
            allocator.free(ptr)


def test_a_torch_function_mode_left_entered_sees_nothing_of_a_pause(engine, segments):
    """A user's TorchFunctionMode entered in one cell and left in another sees only the
    user's own calls: pausing, the figures and resuming run under ``plain_torch``."""
    from torch.overrides import TorchFunctionMode

    seen = []

    class Recording(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Recording():
        torch.ones(2).sum()
        engine.pause()
        engine.stats()
        engine.resume()
        torch.ones(2).sum()
    assert len(seen) == 4, seen
    for ptr, data in segments:
        assert np.array_equal(array(ptr, data.size), data)


def test_the_host_path_refuses_a_staging_area_smaller_than_a_piece():
    from jupyter_vgpu.kernel.codec.host import HostPath
    from jupyter_vgpu.kernel.codec.zstd import Codec
    from jupyter_vgpu.kernel.pause.store import HostStore

    with Codec(threads=1) as codec:
        path = HostPath(torch, None, codec, piece_bytes=1 << 20)
        with pytest.raises(ValueError, match="staging holds 4096 bytes; a piece is 1048576"):
            path.unpack([], HostStore(None, None), torch.empty(4096, dtype=torch.uint8))


def test_a_work_area_keeps_its_address_and_a_pause_never_stores_it(engine, allocator, segments):
    area = WorkArea(allocator, 0, 4 * MiB)
    ptr = area.take()
    array(ptr, 4 * MiB)[:] = 7  # it is memory, mapped
    area.give_back()
    assert resident(ptr, 4 * MiB) == 0, "its memory went back to the system"
    assert {s.ptr: s.mapped for s in allocator.segments()}[ptr] is False
    out = engine.pause()  # the given-back area is a paused segment: not the kernel's, not stored
    assert out.segment_bytes == out.live_bytes == 18 * MiB
    engine.resume()
    assert {s.ptr: s.mapped for s in allocator.segments()}[ptr] is False, "a resume leaves it alone"
    assert area.take() == ptr, "taken again at the same address (the codec's graphs hold it)"
    array(ptr, 4 * MiB)[:] = 1
    area.free()
    assert ptr not in {s.ptr for s in allocator.segments()}
    assert all(np.array_equal(array(p, d.size), d) for p, d in segments)


def test_a_resume_without_room_stays_paused_and_a_later_one_brings_every_byte_back(allocator):
    units = adjacent_units(allocator, 3)
    data = rng.integers(0, 4, 3 * UNIT, dtype=np.uint8)
    array(units[0], 3 * UNIT)[:] = data
    refusing = Refusing(allocator, units[2], on="map")
    e = PauseEngine(torch, refusing, None, threads=2)
    try:
        e.pause()
        with pytest.raises(vmm.DeviceFull):
            e.resume()
        assert e.state == "paused"
        assert not any(s.mapped for s in allocator.segments() if s.ptr in units)
        assert all(resident(ptr, UNIT) == 0 for ptr in units), "nothing mapped stays behind"
        refusing.refused = None
        e.resume()
        assert e.state == "active"
        assert np.array_equal(array(units[0], 3 * UNIT), data)
    finally:
        e.close()
        for ptr in units:
            allocator.free(ptr)
