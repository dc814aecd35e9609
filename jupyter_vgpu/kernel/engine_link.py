"""Creating the offload engine (``jupyter_vgpu.kernel.offload.engine``) for a kernel.

The engine is optional: a kernel whose package lacks it, or whose engine fails to
start, keeps its budget, status and reports, and ``%vgpu offload`` says there is
nothing to do.
"""

from __future__ import annotations

import logging
import os

from jupyter_vgpu.slice import Slice

log = logging.getLogger("jupyter_vgpu")

#: Environment variable: ``1`` makes the engine offload everything after every cell.
CHAOS_ENV = "JUPYTER_VGPU_CHAOS"


def chaos_mode(environ=None) -> bool:
    """True when ``JUPYTER_VGPU_CHAOS=1`` (the engine reads the flag itself)."""
    environ = os.environ if environ is None else environ
    return environ.get(CHAOS_ENV, "") == "1"


def wants_engine(cuda_available: bool) -> bool:
    """Whether a kernel runs the offload engine once torch is imported: with CUDA, or
    in chaos mode (where the engine's CPU stand-in proves offload without a GPU)."""
    return cuda_available or chaos_mode()


def make_engine(slice_: Slice | None):
    """A new ``OffloadEngine.for_kernel(slice_)`` (None: no slice), or None when the
    engine is not installed or fails to start (logged)."""
    try:
        from .offload.engine import OffloadEngine
    except ImportError as e:
        log.info("jupyter-vgpu: no offload engine in this installation (%s)", e)
        return None
    try:
        return OffloadEngine.for_kernel(slice_)
    except Exception:
        log.exception("jupyter-vgpu: the offload engine could not start; continuing without it")
        return None
