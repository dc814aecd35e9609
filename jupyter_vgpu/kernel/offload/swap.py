"""Swapping what two tensor objects hold, keeping each object's identity.

``torch.utils.swap_tensors`` refuses tensors that C++ also references: a tensor with
views (each view holds its base), a gradient (its parameter's autograd metadata holds
it), anything an op's arguments hold while a dispatch mode runs. It protects users who
swap to *change* a tensor for good, where such holders would keep the old one. We swap
to *hide* data and later swap back: the C++ holders keeping the original
implementation is exactly right, because that implementation gets its data back before
anything can use it. So this is ``swap_tensors`` without that use-count check (and
without poisoning the gradient accumulator, which must keep working after the swap
back).
"""

from __future__ import annotations

import copyreg
import weakref

import torch


def swap_impl(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """Exchange the implementations (data, shape, autograd metadata) and the Python
    attributes of ``t1`` and ``t2``; each object keeps its ``id`` and class.

    Raises:
        TypeError: the two are not of the same class.
        RuntimeError: either has weak references (their holders would be surprised).
    """
    if type(t1) is not type(t2):
        raise TypeError(f"cannot swap a {type(t1).__name__} with a {type(t2).__name__}")
    if weakref.getweakrefs(t1) or weakref.getweakrefs(t2):
        raise RuntimeError("cannot swap a tensor that has weak references")
    t1.__dict__, t2.__dict__ = t2.__dict__, t1.__dict__
    for slot in copyreg._slotnames(type(t1)):
        has1, has2 = hasattr(t1, slot), hasattr(t2, slot)
        v1, v2 = getattr(t1, slot, None), getattr(t2, slot, None)
        if has2:
            setattr(t1, slot, v2)
        elif has1:
            delattr(t1, slot)
        if has1:
            setattr(t2, slot, v1)
        elif has2:
            delattr(t2, slot)
    torch._C._swap_tensor_impl(t1, t2)
