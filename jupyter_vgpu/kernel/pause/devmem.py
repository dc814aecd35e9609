"""Tensors viewing raw memory of the pausable allocator, without copying or allocating.

The engine moves segments' bytes with PyTorch's copy kernels and streams, but must not
allocate through PyTorch while it pauses: a temporary could be carved out of a free
block of a segment it has already released. So every buffer it touches is a view of
memory it already owns: device ranges through the CUDA Array Interface (version 3,
``stream: None``: PyTorch adds no synchronisation), host ranges through numpy.
"""

from __future__ import annotations

import ctypes

import numpy as np


class _DeviceRange:
    """An object exposing ``nbytes`` bytes at device address ``ptr`` (CUDA Array Interface)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def device_bytes(torch, ptr: int, nbytes: int, device: int):
    """A ``torch.uint8`` tensor of shape ``(nbytes,)`` viewing device memory at ``ptr``.

    The tensor does not own the memory: it must not outlive the segment it views.
    """
    return torch.as_tensor(_DeviceRange(ptr, nbytes), device=f"cuda:{device}")


def host_bytes(torch, ptr: int, nbytes: int):
    """A CPU ``torch.uint8`` tensor of shape ``(nbytes,)`` viewing host memory at ``ptr``."""
    array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
    return torch.from_numpy(array)


def view(torch, ptr: int, nbytes: int, device: int | None):
    """:func:`device_bytes` for a CUDA ordinal, :func:`host_bytes` for ``device=None``."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return host_bytes(torch, ptr, nbytes) if device is None else device_bytes(torch, ptr, nbytes, device)
