"""Which bytes of each unit hold live data, from PyTorch's allocator snapshot.

A pause must save what tensors hold, and nothing else: PyTorch's caching allocator
cuts its segments into blocks, and ``torch.cuda.memory_snapshot()`` lists them with
their state. Blocks that are allocated, or freed but still in use by a stream
(``active_pending_free``), are live; ``inactive`` blocks are cached free space whose
bytes need not survive.

PyTorch's segments and the allocator's units need not coincide: with the default
allocator each segment is one ``cudaMalloc``, so one unit, but an expandable segment is
one reserved range whose pages are separate ``cuMemCreate`` allocations, each a unit of
its own. So liveness is taken by address: a byte of a unit is live unless a PyTorch
segment covers it with a free block. Bytes no PyTorch segment covers (another library's
memory, CuPy's or JAX's) are live.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence


def _free_intervals(snapshot: Sequence[Mapping]) -> list[tuple[int, int]]:
    """Address ranges ``(start, end)`` of PyTorch's free blocks, sorted, merged."""
    free: list[tuple[int, int]] = []
    for seg in snapshot:
        pos = int(seg["address"])
        for block in seg.get("blocks", ()):
            address = int(block.get("address", pos))
            size = int(block["size"])
            if block.get("state") == "inactive" and size:
                free.append((address, address + size))
            pos = address + size
    free.sort()
    merged: list[tuple[int, int]] = []
    for start, end in free:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def live_ranges(
    snapshot: Sequence[Mapping] | None, segments: Iterable[tuple[int, int]]
) -> dict[int, list[tuple[int, int]]]:
    """Live ``(offset, length)`` ranges of each unit, in bytes, in address order, adjacent
    ones merged.

    Args:
        snapshot: ``torch.cuda.memory_snapshot()`` (a list of segment dicts with
            ``address``, ``total_size`` and ``blocks``: dicts with ``size``, ``state``
            and, from PyTorch 2.1 on, ``address``), or None to treat every unit as
            wholly live.
        segments: ``(address, size)`` of the allocator's units, bytes.

    Returns:
        For each unit address, its live ranges (empty when only free blocks cover it).
    """
    units = list(segments)
    if snapshot is None:
        return {ptr: [(0, size)] for ptr, size in units}
    free = _free_intervals(snapshot)
    starts = [start for start, _ in free]
    out: dict[int, list[tuple[int, int]]] = {}
    for ptr, size in units:
        end, pos, runs = ptr + size, ptr, []
        i = max(0, bisect.bisect_right(starts, ptr) - 1)
        while pos < end:
            while i < len(free) and free[i][1] <= pos:
                i += 1
            if i < len(free) and free[i][0] <= pos:  # pos is free: skip past the block
                pos = min(end, free[i][1])
                continue
            stop = min(end, free[i][0]) if i < len(free) else end
            runs.append((pos - ptr, stop - pos))
            pos = stop
        out[ptr] = runs
    return out


def spans(
    units: Iterable[tuple[int, int, int]],
    live: Mapping[int, Sequence[tuple[int, int]]],
    grid: int | None = None,
) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """Live ranges joined across units that lie side by side in the address space.

    An expandable segment of PyTorch is one reserved range whose 20 MiB pages are
    separate units, and a range cut at every page boundary would leave the codec a short
    last piece per page (slower than whole pieces: :mod:`..codec.device`). Joined, the
    codec sees the segment's live bytes as the caller does, whole.

    With ``grid`` (the codec's piece bytes), pieces are laid out for sharing
    (:mod:`.sharing`): the codec cuts a span into pieces from its start, so each span
    starts on a point of its unit's grid (the unit's address plus a multiple of ``grid``;
    a head before the first point is a span of its own), and a span runs on into the next
    unit only where the grid does (its unit's size is a multiple of ``grid``). Every piece
    is then the live bytes of one cell of one unit's grid, whatever lives around it: two
    kernels holding the same tensor at the same offset of a unit store the same piece,
    where span by span one block live in one kernel and free in the other (or two units
    side by side in one and apart in the other) moved every piece after it.

    Args:
        units: ``(address, size, device)`` of the units paused together, bytes.
        live: :func:`live_ranges` of those units.
        grid: bytes between two points of a unit's grid, or None (spans as long as the
            live bytes run).

    Returns:
        ``(unit, offset, length, covered)`` in address order: the unit the span starts in,
        its offset there and its length in bytes (it may run past that unit's end into
        the next ones), and the address of every unit it covers, in order.
    """
    units = sorted(units)  # read twice below: an iterator would be empty the second time
    out: list[tuple[int, int, int, tuple[int, ...]]] = []
    end = device = None
    joins = True  # whether a span may run on past the end of the unit before
    for ptr, size, dev in units:
        for off, length in live[ptr]:
            if length <= 0:
                continue
            if end == ptr + off and device == dev and joins:
                first, first_off, total, covered = out[-1]
                if covered[-1] != ptr:
                    covered = (*covered, ptr)
                out[-1] = (first, first_off, total + length, covered)
            else:
                out.append((ptr, off, length, (ptr,)))
            end, device = ptr + off + length, dev
        joins = grid is None or size % grid == 0
    if grid is None:
        return out
    sizes = {ptr: size for ptr, size, _ in units}
    return [part for span in out for part in _on_grid(span, grid, sizes)]


def _on_grid(span, grid: int, sizes: Mapping[int, int]) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """``span`` cut at the first point of its unit's grid, where it starts off the grid
    and runs past that point (:func:`spans`)."""
    unit, off, length, covered = span
    head = -off % grid
    if head == 0 or head >= length:
        return [span]
    start = off + head  # where the rest begins, from ``unit``'s address
    rest = list(covered)
    while start >= sizes[rest[0]]:  # the point is the end of a unit: the rest is in the next
        start -= sizes[rest.pop(0)]
    return [(unit, off, head, (unit,)), (rest[0], start, length - head, tuple(rest))]
