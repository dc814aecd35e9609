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


def cached_free_bytes(torch, devices) -> int:
    """Bytes PyTorch's caching allocator keeps reserved and unallocated on ``devices`` (CUDA
    ordinals): ``memory_reserved - memory_allocated``, which a pause releases unstored. 0
    before PyTorch initialized CUDA. Reads the allocator's statistics; no driver call."""
    cuda = torch.cuda
    if not cuda.is_initialized():
        return 0
    return sum(cuda.memory_reserved(d) - cuda.memory_allocated(d) for d in devices)


@contextlib.contextmanager
def plain_torch(torch):
    """Run PyTorch calls as plain kernels: a user's TorchFunctionMode or dispatch mode left
    entered across cells must not see (or change) what the pause path does."""
    from torch.utils._python_dispatch import _disable_current_modes

    with torch._C.DisableTorchFunction(), _disable_current_modes():
        yield
