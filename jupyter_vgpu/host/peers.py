"""Who is on the other end of a Unix socket, and which server a process belongs to.

The arbiter never believes what a kernel says about itself: the kernel's process is
the socket's peer (``SO_PEERCRED``: PID, UID, GID, filled in by the Linux kernel), and
its server is the registered process tree it descends from (``/proc/<pid>/stat``'s
parent links). A kernel cannot speak for another process, nor move itself into another
user's tree.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterable

from . import procs


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket.

    Raises:
        OSError: not a connected Unix socket.
    """
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` (None when it is gone or is init)."""
    st = procs.stat(pid)
    return (st.ppid or None) if st is not None else None


def ancestors(pid: int, limit: int = 64) -> list[int]:
    """``pid`` and its ancestors, nearest first (at most ``limit`` of them)."""
    chain = []
    while pid and len(chain) < limit:
        chain.append(pid)
        pid = parent_pid(pid)
    return chain


def root_in(pid: int, roots: Iterable[int]) -> int | None:
    """The nearest ancestor of ``pid`` (``pid`` included) that is one of ``roots``."""
    wanted = set(roots)
    return next((p for p in ancestors(pid) if p in wanted), None)


def descendants(root: int, pids: Iterable[int]) -> list[int]:
    """Those of ``pids`` that descend from ``root`` (``root`` included)."""
    return [p for p in pids if root in ancestors(p)]


def alive(pid: int) -> bool:
    """True when process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
