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
    units: Iterable[tuple[int, int, int]], live: Mapping[int, Sequence[tuple[int, int]]]
) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """Live ranges joined across units that lie side by side in the address space.

    An expandable segment of PyTorch is one reserved range whose 20 MiB pages are
    separate units, and a range cut at every page boundary would leave the codec a short
    last piece per page (slower than whole pieces: :mod:`..codec.device`). Joined, the
    codec sees the segment's live bytes as the caller does, whole.

    Args:
        units: ``(address, size, device)`` of the units paused together, bytes.
        live: :func:`live_ranges` of those units.

    Returns:
        ``(unit, offset, length, covered)`` in address order: the unit the span starts in,
        its offset there and its length in bytes (it may run past that unit's end into
        the next ones), and the address of every unit it covers, in order.
    """
    out: list[tuple[int, int, int, tuple[int, ...]]] = []
    end = device = None
    for ptr, _size, dev in sorted(units):
        for off, length in live[ptr]:
            if length <= 0:
                continue
            if end == ptr + off and device == dev:
                first, first_off, total, covered = out[-1]
                if covered[-1] != ptr:
                    covered = (*covered, ptr)
                out[-1] = (first, first_off, total + length, covered)
            else:
                out.append((ptr, off, length, (ptr,)))
            end, device = ptr + off + length, dev
    return out
