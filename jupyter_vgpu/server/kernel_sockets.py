"""A server's kernels' Unix sockets, in a short directory of their own.

Over TCP a kernel's channels listen on the loopback interface, where every account of the
host can connect; their messages are signed, not encrypted, so another user who subscribes
to a kernel's IOPub port reads every output of its cells. A server the Hub spawns runs its
kernels over ZeroMQ's ``ipc`` transport instead (``VGPUHub.kernel_transport``, passed as
``--KernelManager.transport=ipc``): Unix sockets, reached only through directories their
owner lets others into.

jupyter_client names a kernel's sockets after its connection file, in the runtime
directory: ``<runtime>/kernel-<id>-ipc-<n>``. A Unix socket's path has at most 107 bytes
(``sun_path`` less its final NUL, unix(7)), and that name alone takes 54 of them, so a
runtime directory deeper than 53 bytes (``/home/<name>/.local/share/jupyter/runtime``
for a name of 19 characters) refuses every kernel. :func:`keep_short` gives each kernel of
the server sockets in one directory made for them, ``tempfile.mkdtemp`` in the system's
temporary directory (mode 0700, a name no one could take first):
``/tmp/jupyter-vgpu-XXXXXXXX/kernel-<id>-<n>``, about 64 bytes. The directory goes when the
server exits. A kernel whose ``KernelManager.ip`` was set keeps it, and TCP is untouched.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

#: Bytes of a Unix socket's path, its final NUL left out (``sun_path`` of ``sockaddr_un``
#: is 108 bytes on Linux, unix(7)).
SOCKET_PATH_MAX = 107


def keep_short(kernels, make_dir=None) -> None:
    """Make the kernels of ``kernels`` (a ``MultiKernelManager``) that use the ``ipc``
    transport with jupyter_client's default socket names put their sockets in a
    directory of their own: made at the first such kernel by ``make_dir`` (default
    ``tempfile.mkdtemp(prefix="jupyter-vgpu-")``), removed at exit.

    Raises:
        OSError: at a kernel's start, the directory could not be made (the kernel is not
            started).
    """
    factory = kernels.kernel_manager_factory
    made: list[str] = []

    def create(*args, **kwargs):
        manager = factory(*args, **kwargs)
        if manager.transport == "ipc" and manager.connection_file:
            name = os.path.splitext(manager.connection_file)[0]
            if manager.ip == name + "-ipc":  # jupyter_client's own choice, not a setting
                if not made:
                    made.append(make_dir() if make_dir else tempfile.mkdtemp(prefix="jupyter-vgpu-"))
                    atexit.register(shutil.rmtree, made[0], ignore_errors=True)
                manager.ip = os.path.join(made[0], Path(name).name)
        return manager

    kernels.kernel_manager_factory = create
