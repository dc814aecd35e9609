"""The disk tier's directories on the node: one per kernel, readable by its user and the arbiter.

Layout under ``ArbiterApp.disk_dir`` (the root, mode 0711, the arbiter's: anyone may
pass through it, nobody but the arbiter may list it or make anything in it)::

    <root>/<uid>/                      mode 0700, the user's (handed over by a root arbiter)
    <root>/<uid>/kernel-<pid>-<start>/ made by the kernel, mode 0700; its files 0600

The arbiter makes the root itself when it starts (:class:`DiskTier`), through
:mod:`.safe_dirs`: no component on the way may be a link, another user's, or writable by
others (a sticky ``/tmp`` aside, where the next component must be the arbiter's own), so
no user can have made any of it first. Everything it does below the root later goes
through the root's open descriptor, never by name: a user's directory is made, checked
and handed to its user with ``mkdirat``/``fchown``/``fchmod``; a kernel's is sized and
removed without following links.

``<start>`` is the process's start time (``/proc/<pid>/stat`` field 22, clock ticks
after boot), so a PID the system hands out again never meets another process's files.
Only the kernel's user and the arbiter (root, or the same user) can read them. A kernel
that dies (killed, at any step) leaves its directory behind; :meth:`DiskTier.sweep`
removes every directory whose process no longer exists, at the arbiter's start, when a
kernel's connection ends, and every few seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from jupyter_vgpu.host.procs import start_time

from . import safe_dirs

log = logging.getLogger("jupyter_vgpu.node")


def default_root() -> str:
    """``/var/lib/jupyter-vgpu/disk`` for root; ``$XDG_CACHE_HOME/jupyter-vgpu/disk``
    (``~/.cache/jupyter-vgpu/disk``) for anyone else: disk-backed directories (``/run``
    and often ``/tmp`` are memory) that no other user can make first (never ``/var/tmp``)."""
    if os.geteuid() == 0:
        return "/var/lib/jupyter-vgpu/disk"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "jupyter-vgpu", "disk")


def kernel_name(pid: int, start: int) -> str:
    """The name of the directory of the kernel ``pid`` started at ``start`` (clock ticks)."""
    return f"kernel-{pid}-{start}"


def owner_alive(name: str) -> bool:
    """True when the process a ``kernel-<pid>-<start>`` directory belongs to still
    exists (and for names that are not of that form: not ours, left alone)."""
    try:
        _, pid, start = name.split("-")
        return start_time(int(pid)) == int(start)
    except ValueError:
        return True


class DiskTier:
    """The disk tier of one arbiter, its root made and held open.

    Args:
        root: the root directory (``ArbiterApp.disk_dir``).

    Raises:
        safe_dirs.UnsafePath: the root, or a directory on the way to it, is a link,
            another user's, or writable by others (the message says which).
        OSError: it cannot be made.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = str(root)
        self.fd = safe_dirs.open_dir(self.root, mode=0o711)

    def close(self) -> None:
        os.close(self.fd)

    def user_dir(self, uid: int) -> str:
        """``<root>/<uid>``, made if needed, the user's alone (0700); returns its path.

        Raises:
            safe_dirs.UnsafePath: something other than the user's own directory is there.
            OSError: it cannot be made.
        """
        fd = safe_dirs.user_dir(self.fd, str(uid), uid, shown=os.path.join(self.root, str(uid)))
        os.close(fd)
        return os.path.join(self.root, str(uid))

    def kernel_dir(self, uid: int, pid: int, start: int) -> str:
        """Where the kernel ``pid`` (started at ``start``) of user ``uid`` keeps its disk
        tier (the kernel makes it)."""
        return os.path.join(self.root, str(uid), kernel_name(pid, start))

    def _user_fd(self, uid: str) -> int | None:
        try:
            return os.open(uid, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError:
            return None

    def remove(self, uid: int, pid: int, start: int) -> None:
        """Remove the directory of the kernel ``pid`` (started at ``start``) of user
        ``uid`` and all in it (nothing when it is gone)."""
        fd = self._user_fd(str(uid))
        if fd is None:
            return
        try:
            safe_dirs.remove_below(fd, kernel_name(pid, start))
        except OSError as e:
            log.warning("the disk tier directory of kernel %s could not be removed: %s", pid, e)
        finally:
            os.close(fd)

    def size(self, uid: int, pid: int, start: int) -> int:
        """Bytes in the directory of the kernel ``pid`` of user ``uid`` (0 when gone)."""
        fd = self._user_fd(str(uid))
        if fd is None:
            return 0
        try:
            return safe_dirs.size_below(fd, kernel_name(pid, start))
        finally:
            os.close(fd)

    def sweep(self) -> list[str]:
        """Remove the directories of kernels that no longer exist; returns the paths removed."""
        removed = []
        try:
            users = [u for u in os.listdir(self.fd) if u.isdigit()]
        except OSError:
            return removed
        for uid in users:
            fd = self._user_fd(uid)
            if fd is None:
                continue
            try:
                for name in os.listdir(fd):
                    if name.startswith("kernel-") and not owner_alive(name):
                        try:
                            safe_dirs.remove_below(fd, name)
                        except OSError as e:
                            log.warning("%s could not be removed: %s", os.path.join(self.root, uid, name), e)
                            continue
                        removed.append(os.path.join(self.root, uid, name))
            except OSError:
                pass
            finally:
                os.close(fd)
        return removed

    def probe(self) -> str | None:
        """Write a few KiB into the root (a file nobody else sees, gone at once): None when
        the disk takes them, else why not. What a kernel says of the disk is checked so
        before the arbiter believes it: a kernel's own trouble (its user's quota, or a
        lie) must not stop everyone's spills."""
        try:
            try:
                fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
                name = None
            except OSError:  # a file system without O_TMPFILE
                name = f".probe-{os.getpid()}"
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=self.fd)  # fmt: skip
            try:
                os.write(fd, b"\0" * 4096)
                os.fsync(fd)
            finally:
                os.close(fd)
                if name is not None:
                    os.unlink(name, dir_fd=self.fd)
        except OSError as e:
            return f"{type(e).__name__}: {e}"
        return None

    def free_bytes(self) -> int | None:
        """Bytes free for an unprivileged user on the root's file system, or None."""
        with contextlib.suppress(OSError):
            info = os.fstatvfs(self.fd)
            return info.f_bavail * info.f_frsize
        return None


def free_bytes(root: str | Path) -> int | None:
    """Bytes free for an unprivileged user on the file system of ``root``, or None."""
    try:
        info = os.statvfs(root)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize
