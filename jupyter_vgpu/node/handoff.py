"""One arbiter per socket: a new one takes over from the one before it.

A Hub killed with SIGKILL leaves its managed services running; the Hub that starts
next starts a new arbiter on the same socket. Two arbiters would each hold half of the
kernels (those connected before and after), each unaware of the other's pauses. So an
arbiter holds an exclusive ``flock`` on ``arbiter.lock`` beside its socket, with its PID
in the file. One that starts while the lock is held asks the holder to stop (SIGTERM: it
hangs up on its kernels, which reconnect to the new one), waits for the lock, and ends
the holder with SIGKILL if it does not let go within ``timeout`` seconds. The lock is
the operating system's: it goes with the process, however the process ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger("jupyter_vgpu.node")


def _try(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _wait(fd: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _try(fd):
            return True
        time.sleep(0.05)
    return False


def take(path: str | Path, timeout: float = 15.0) -> int:
    """Hold the lock at ``path`` (made, mode 0600), taking it over from its holder;
    returns the open descriptor (keep it open: closing it lets go).

    Raises:
        OSError: the lock file cannot be opened, or its holder outlived SIGKILL.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    if not _try(fd):
        try:
            holder = int(os.pread(fd, 32, 0).split()[0])
        except (ValueError, IndexError):
            holder = None
        log.warning("another arbiter (pid %s) serves this socket: asking it to hand over", holder)
        if holder and holder != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(holder, signal.SIGTERM)
        if not _wait(fd, timeout):
            if holder and holder != os.getpid():
                log.warning("the arbiter %s did not stop within %.0f s: ending it", holder, timeout)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(holder, signal.SIGKILL)
            if not _wait(fd, 10.0):
                os.close(fd)
                raise OSError(f"the arbiter holding {path} (pid {holder}) does not let go")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
