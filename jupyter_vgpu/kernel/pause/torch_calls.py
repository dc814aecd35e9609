"""PyTorch calls of the pause path: made as plain ones, its pinned-memory cache emptied, and
the device memory its caching allocator keeps free."""

from __future__ import annotations

import contextlib


def empty_host_cache(torch) -> None:
    """Give PyTorch's cached pinned host memory back to the system (after a spill or a
    trim: the slabs let go went back to that cache, which would keep them). Without CUDA
    there is no pinned memory, and nothing to do."""
    if not torch.cuda.is_available():
        return
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    empty = empty or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def unstored_bytes(torch, devices) -> int:
    """Bytes PyTorch's caching allocator keeps reserved and unallocated on ``devices`` (CUDA
    ordinals): ``memory_reserved - memory_allocated``, every free block, those of segments
    that also hold a live tensor included. A pause stores the live ranges only
    (:func:`.ranges.live_ranges`), so what it would store is the pausable bytes mapped less
    these; what a release gives back is less again (:func:`cached_free_bytes`). 0 before
    PyTorch initialized CUDA. Reads the allocator's statistics; no driver call."""
    cuda = torch.cuda
    if not cuda.is_initialized():
        return 0
    return sum(cuda.memory_reserved(d) - cuda.memory_allocated(d) for d in devices)


def cached_free_bytes(torch, devices) -> int:
    """Bytes PyTorch's caching allocator would give back on ``devices`` (CUDA ordinals) at an
    ``empty_cache``, which a release gives back (and a pause releases unstored): its reserved
    bytes less the active ones (allocated, or freed with a stream's work still pending) and
    less the inactive bytes of segments that also hold an active block, which ``empty_cache``
    cannot free (PyTorch's ``memory_stats``: ``reserved_bytes``, ``active_bytes`` and
    ``inactive_split_bytes``, pool ``all``, ``current``). ``memory_reserved -
    memory_allocated`` counted those too: on an H200, 3.19 GiB said where ``empty_cache``
    gave back 2.0 GiB after an MLP step, and 306 of the 374 releases a 12x MLP run asked
    for gave back nothing (``benchmarks/results/gpu-tests-h200x2.log``,
    ``sessions-h100.json``, f922f59). Not what a pause stores: that leaves out every free
    block (:func:`unstored_bytes`). 0 before PyTorch initialized CUDA. Reads the
    allocator's statistics; no driver call."""
    cuda = torch.cuda
    if not cuda.is_initialized():
        return 0
    total = 0
    for device in devices:
        stats = cuda.memory_stats(device)
        total += max(
            0,
            stats.get("reserved_bytes.all.current", 0)
            - stats.get("active_bytes.all.current", 0)
            - stats.get("inactive_split_bytes.all.current", 0),
        )
    return total


@contextlib.contextmanager
def plain_torch(torch):
    """Run PyTorch calls as plain kernels: a user's TorchFunctionMode or dispatch mode left
    entered across cells must not see (or change) what the pause path does."""
    from torch.utils._python_dispatch import _disable_current_modes

    with torch._C.DisableTorchFunction(), _disable_current_modes():
        yield
