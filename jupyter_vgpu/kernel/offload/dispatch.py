"""Restore on touch: a torch function mode that brings offloaded tensors back before
any torch call (op, method or property) that receives them.

A *function* mode rather than a dispatch mode: it runs above autograd, so the call
proceeds, and autograd records, with the restored tensor, never the placeholder.
Pushed only while something is offloaded (a Python mode costs a few µs per op: 8.7 →
15.3 µs on small ops on the H100, design map), so a kernel with nothing offloaded runs
at full speed.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._pytree import tree_leaves


class RestoreOnTouch(TorchFunctionMode):
    """Before any torch call, restores the offloaded tensors among its arguments.

    Args:
        restore: called with the offloaded tensors a call is about to touch; it swaps
            their data back in place (the same Python objects).
        is_offloaded: tells whether a tensor object is an offloaded placeholder.
    """

    def __init__(self, restore, is_offloaded):
        super().__init__()
        self._restore = restore
        self._is_offloaded = is_offloaded

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        touched = [t for t in leaves if isinstance(t, torch.Tensor) and self._is_offloaded(t)]
        if touched:
            self._restore(touched)
        return func(*args, **kwargs)

    def is_innermost(self) -> bool:
        """True when no other function mode was pushed after this one."""
        stack = _get_current_function_mode_stack()
        return bool(stack) and stack[-1] is self
