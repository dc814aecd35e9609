"""PyTorch calls of the pause path: made as plain ones, and its pinned-memory cache emptied."""

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


@contextlib.contextmanager
def plain_torch(torch):
    """Run PyTorch calls as plain kernels: a user's TorchFunctionMode or dispatch mode left
    entered across cells must not see (or change) what the pause path does."""
    from torch.utils._python_dispatch import _disable_current_modes

    with torch._C.DisableTorchFunction(), _disable_current_modes():
        yield
