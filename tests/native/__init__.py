"""A CUDA driver and runtime on host memory (``fake_cuda.c``, ``fake_cudart.c``) for testing
the pausable allocator's interposition without a GPU, and running code in a process that
preloads the allocator over them."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

from jupyter_vgpu.kernel.pause import vmm
from jupyter_vgpu.testing import preloaded

HERE = Path(__file__).parent


def build(directory: Path) -> Path:
    """Compile the stand-ins into ``directory`` as ``libcuda.so.1`` and ``libcudart.so.13``,
    with the library's flags (every warning an error) and its ``driver.h``, whose table
    holds the driver stand-in's functions to the signatures the library calls."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    directory.mkdir(parents=True, exist_ok=True)
    for source, name in (("fake_cuda.c", "libcuda.so.1"), ("fake_cudart.c", "libcudart.so.13")):
        command = [*vmm.compile_command(compiler, str(directory / name), (HERE / source,)), f"-I{vmm.NATIVE}"]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise AssertionError(f"building {source} failed:\n{result.stderr}")
    return directory


def _first_on_library_path(directory: Path) -> dict[str, str]:
    return {"LD_LIBRARY_PATH": os.pathsep.join([str(directory), os.environ.get("LD_LIBRARY_PATH", "")])}


def environment(directory: Path, **extra: str) -> dict[str, str]:
    """A process environment that preloads the allocator over the stand-ins in ``directory``."""
    return preloaded.environment(**{**_first_on_library_path(directory), **extra})


PRELUDE = """
import ctypes, json, os, sys
from jupyter_vgpu.kernel.pause import vmm as _vmm
lib = ctypes.CDLL(str(_vmm.library_path()))
cuda = ctypes.CDLL("libcuda.so.1")
cuda.fake_cuda_used.restype = ctypes.c_uint64
u64, size_t, vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p

def address(fn):
    return ctypes.cast(fn, vp).value

def start():
    assert cuda.cuInit(0) == 0
    ctx = vp()
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    assert cuda.cuCtxSetCurrent(ctx) == 0

def alloc(n):
    p = u64()
    r = cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(n))
    assert r == 0, r
    return p.value

def units():
    return [(s.ptr, s.size, s.kind, s.pausable, s.mapped) for s in _vmm.load().segments()]

def used():
    return cuda.fake_cuda_used()
"""


def run(directory: Path, code: str, timeout: float = 60, **extra: str) -> dict:
    """Run :data:`PRELUDE` and ``code`` (dedented) in a preloaded process over the
    stand-ins; return the JSON object it printed last. Fails with its output when it
    exits non-zero."""
    env = {**_first_on_library_path(directory), **extra}
    return preloaded.run(PRELUDE + textwrap.dedent(code), timeout, **env)
