"""Restore on touch: a dispatch mode that brings offloaded tensors back before an op.

Pushed only while something is offloaded (about 6 µs per op while active on the H100,
8.7 → 15.3 µs on small ops; design map), so a kernel with nothing offloaded runs at
full speed.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class RestoreOnTouch(TorchDispatchMode):
    """Before any op, restores the offloaded tensors among its arguments.

    Args:
        restore: called with the list of offloaded tensors an op is about to touch;
            it must swap their data back in place (same Python objects).
        is_offloaded: tells whether a tensor object is an offloaded placeholder.
    """

    def __init__(self, restore, is_offloaded):
        super().__init__()
        self._restore = restore
        self._is_offloaded = is_offloaded

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        touched = [
            t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and self._is_offloaded(t)
        ]
        if touched:
            self._restore(touched)
        return func(*args, **kwargs)
