"""One arbiter per socket: a new one takes over from the one before it.

A Hub killed with SIGKILL leaves its managed services running; the Hub that starts
next starts a new arbiter on the same socket. Two arbiters would each hold half of the
kernels (those connected before and after), each unaware of the other's pauses. So an
arbiter holds an exclusive ``flock`` on ``arbiter.lock`` beside its socket, with its PID
in the file. One that starts while the lock is held asks the holder to stop (SIGTERM: it
hangs up on its kernels, which reconnect to the new one), waits for the lock, and ends
the holder with SIGKILL if it does not let go within ``timeout`` seconds. The lock is
the operating system's: it goes with the process, however the process ends.

The file is opened in the socket's directory, already checked (:mod:`.safe_dirs`: the
arbiter's user's or root's, writable by no one else), without following a link, and is
refused unless it is a plain file of the arbiter's user. The PID in it is believed only
for a process of the arbiter's own user (or root) whose command line is an arbiter's:
any other is never signalled, whatever the file says.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import stat
import time

from jupyter_vgpu.host import procs

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


#: The lock's name in the socket's directory.
LOCK_NAME = "arbiter.lock"


def _an_arbiter(pid: int) -> procs.Identity | None:
    """The process ``pid`` when it is an arbiter of this user (or root), else None."""
    ident = procs.Identity.of(pid)
    if ident is None or ident.uid not in (0, os.geteuid()):
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    if any("jupyter_vgpu.node" in w or "jupyter-vgpu-arbiter" in w for w in words):
        return ident
    ident.close()
    return None


def take(directory: int, timeout: float = 15.0, name: str = LOCK_NAME) -> int:
    """Hold the lock ``name`` in the open directory ``directory`` (made, mode 0600),
    taking it over from its holder; returns the open descriptor (keep it open: closing
    it lets go).

    Raises:
        OSError: the lock file cannot be opened or is not a plain file of this user, or
            its holder does not let go (outlived SIGKILL, or is not an arbiter).
    """
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=directory)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise OSError(f"the lock {name} is not a plain file of uid {os.geteuid()}: refused")
    if not _try(fd):
        try:
            holder = int(os.pread(fd, 32, 0).split()[0])
        except (ValueError, IndexError):
            holder = None
        ident = _an_arbiter(holder) if holder and holder != os.getpid() else None
        if ident is not None:
            log.warning("another arbiter (pid %s) serves this socket: asking it to hand over", holder)
            ident.send(signal.SIGTERM)
        else:
            log.warning("the lock is held by pid %s, which is not an arbiter of this user: waiting", holder)
        if not _wait(fd, timeout):
            if ident is not None:
                log.warning("the arbiter %s did not stop within %.0f s: ending it", holder, timeout)
                ident.send(signal.SIGKILL)
            if not _wait(fd, 10.0):
                os.close(fd)
                raise OSError(f"the process holding {name} (pid {holder}) does not let go")
        if ident is not None:
            ident.close()
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
