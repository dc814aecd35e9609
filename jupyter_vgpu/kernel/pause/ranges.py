"""Which bytes of each segment hold live data, from PyTorch's allocator snapshot.

A pause must save what tensors hold, and nothing else: PyTorch's caching allocator
cuts each segment (one ``cudaMalloc``, so one segment of the pausable allocator) into
blocks, and ``torch.cuda.memory_snapshot()`` lists them with their state. Blocks that
are allocated, or freed but still in use by a stream (``active_pending_free``), are
live; ``inactive`` blocks are cached free space whose bytes need not survive. A
segment PyTorch does not know (another library's ``cudaMalloc``) is live as a whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def live_ranges(
    snapshot: Sequence[Mapping] | None, segments: Iterable[tuple[int, int]]
) -> dict[int, list[tuple[int, int]]]:
    """Live ``(offset, length)`` ranges of each segment, in bytes, adjacent ones merged.

    Args:
        snapshot: ``torch.cuda.memory_snapshot()`` (a list of segment dicts with
            ``address``, ``total_size`` and ``blocks``: dicts with ``size``, ``state``
            and, from PyTorch 2.1 on, ``address``), or None to treat every segment as
            wholly live.
        segments: ``(address, size)`` of the allocator's segments.

    Returns:
        For each segment address, its live ranges in address order (empty when the
        segment holds only free blocks).
    """
    known = {}
    for seg in snapshot or ():
        start, pos, runs = int(seg["address"]), int(seg["address"]), []
        for block in seg.get("blocks", ()):
            address = int(block.get("address", pos))
            size = int(block["size"])
            if block.get("state") != "inactive":
                if runs and runs[-1][0] + runs[-1][1] == address - start:
                    runs[-1] = (runs[-1][0], runs[-1][1] + size)
                else:
                    runs.append((address - start, size))
            pos = address + size
        known[start] = runs
    if snapshot is None:
        return {ptr: [(0, size)] for ptr, size in segments}
    return {ptr: known.get(ptr, [(0, size)]) for ptr, size in segments}
