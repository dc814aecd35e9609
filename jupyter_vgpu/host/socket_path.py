"""Where the node arbiter listens: one path agreed by the Hub, the arbiter, servers and kernels.

The Hub (``hub_spawner.setup``) picks the path, starts the arbiter on it and gives it to
every server in ``JUPYTER_VGPU_ARBITER``; servers pass their environment on to kernels.
The socket's directory is writable by the arbiter's user alone (see
:meth:`jupyter_vgpu.node.arbiter.Arbiter.start`), so no user can put a socket of their
own in its place.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

#: Environment variable naming the arbiter's socket to the arbiter, servers and kernels.
SOCKET_ENV = "JUPYTER_VGPU_ARBITER"


def default_socket() -> str:
    """``$JUPYTER_VGPU_ARBITER``, else ``/run/jupyter-vgpu/arbiter.sock`` for root, else
    ``jupyter-vgpu/arbiter.sock`` in the user's Jupyter runtime directory."""
    if os.environ.get(SOCKET_ENV):
        return os.environ[SOCKET_ENV]
    if os.getuid() == 0:
        return "/run/jupyter-vgpu/arbiter.sock"
    from jupyter_core.paths import jupyter_runtime_dir

    return str(Path(jupyter_runtime_dir()) / "jupyter-vgpu" / "arbiter.sock")


def mps_pipe_directory(socket: str, gpu_uuid: str) -> str:
    """The pipe directory of the MPS control daemon the arbiter listening on ``socket``
    runs for GPU ``gpu_uuid``: ``<socket's directory>/mps/<12 hex digits>/pipe``, the
    digits the start of the UUID's SHA-1 (a GPU UUID is 40 characters, and the daemon's
    Unix sockets in this directory must fit ``sun_path``'s 108 bytes). Clients (kernels of
    ``mps`` slices) find their daemon through ``CUDA_MPS_PIPE_DIRECTORY`` set to it."""
    digest = hashlib.sha1(gpu_uuid.encode()).hexdigest()[:12]
    return str(Path(socket).parent / "mps" / digest / "pipe")
