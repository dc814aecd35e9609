"""Where the kernel side keeps what it builds once per user: the pausable allocator's
shared library (``pause.vmm``) and the codec's compiled kernels (``codec.kernels``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/jupyter-vgpu``, else ``~/.cache/jupyter-vgpu`` (not created here)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jupyter-vgpu"
