"""The pausable allocator's host stand-in, for the pause engine's tests on a machine
without a GPU: the process's allocator (:func:`host_allocator`) and a view of the
bytes at an address (:func:`array`)."""

import ctypes

import numpy as np
import pytest

from jupyter_vgpu.kernel.pause import vmm


def host_allocator():
    """The process's pausable allocator on its host backend (skips the test where it runs
    on CUDA): for a fixture of the tests' module."""
    lib = vmm.load()
    if lib.backend == 0:
        lib.init(vmm.HOST)
    if lib.backend != vmm.HOST:
        pytest.skip("this process's allocator runs on CUDA")
    return lib


def array(ptr: int, nbytes: int) -> np.ndarray:
    """The ``nbytes`` bytes at ``ptr``, as a writable uint8 array (no copy)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
