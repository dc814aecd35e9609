"""Directories the arbiter makes and changes as root, where no user can have been first.

A root process that opens, chowns or chmods a path by name follows every symbolic link
on the way, and a user who made one component first (under ``/var/tmp``, under any
directory writable by all) decides where that path leads: a link to ``/etc`` turned
the disk tier's ``chown`` into ``/etc`` owned by that user. So every directory the
arbiter owns is reached here one component at a time, each opened relative to the one
before (``openat``) with ``O_NOFOLLOW | O_DIRECTORY``, its owner and mode checked on
the open descriptor (``fstat``), and changed only through that descriptor
(``fchown``, ``fchmod``):

- every component on the way must belong to root or to the arbiter's own user, and be
  writable by no one else, except a directory with the sticky bit (``/tmp``, mode
  1777), where no user can rename or remove another's entries: the component after it
  must then be the arbiter's (or root's) own;
- a missing component is made (``mkdirat``), then checked as if it had been found;
- anything else (a link, a file, another user's directory, one writable by others) is
  refused with :class:`UnsafePath`, which says which component and why.

The descriptors returned stay valid whatever happens to the names later: work below
them (making a user's directory, removing a kernel's files, sizing them) goes through
``dir_fd`` too (:func:`user_dir`, :func:`remove_below`, :func:`size_below`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat as st
from pathlib import Path

_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(OSError):
    """A directory the arbiter would use as root is not safe to use; the message names
    the component and what is wrong with it."""


def _owners() -> tuple[int, ...]:
    return (0, os.geteuid())


def _open_at(parent: int | None, name: str, shown: str) -> int:
    try:
        return os.open(name, _OPEN, dir_fd=parent)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePath(f"{shown} is not a directory (a symbolic link or a file): refused") from None
        raise


def _check(fd: int, shown: str, last: bool) -> None:
    info = os.fstat(fd)
    if info.st_uid not in _owners():
        raise UnsafePath(
            f"{shown} belongs to uid {info.st_uid}, not to root or to this process's user "
            f"(uid {os.geteuid()}): refused (another user may have made it first)"
        )
    writable_by_others = info.st_mode & (st.S_IWGRP | st.S_IWOTH)
    if writable_by_others and (last or not info.st_mode & st.S_ISVTX):
        raise UnsafePath(f"{shown} is writable by other users (mode {st.S_IMODE(info.st_mode):04o}): refused")


def open_dir(path: str | os.PathLike, create: bool = True, mode: int = 0o755) -> int:
    """Open the directory ``path`` safely (see the module's docstring), making what is
    missing of it (``mode``, subject to the umask, then set exactly on the last
    component); returns its descriptor (``O_RDONLY | O_DIRECTORY``, close-on-exec; the
    caller closes it).

    Raises:
        UnsafePath: a component is a link or a file, belongs to another user, or is
            writable by others (see the module's docstring).
        FileNotFoundError: a component is missing and ``create`` is False.
        OSError: the file system refused (read-only, full, no permission).
    """
    path = Path(os.path.abspath(path))
    fd = _open_at(None, "/", "/")
    shown = Path("/")
    try:
        parts = path.parts[1:]
        for i, name in enumerate(parts):
            shown = shown / name
            last = i == len(parts) - 1
            try:
                child = _open_at(fd, name, str(shown))
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):  # made meanwhile: checked below
                    os.mkdir(name, mode if last else 0o755, dir_fd=fd)
                child = _open_at(fd, name, str(shown))
            os.close(fd)
            fd = child
            _check(fd, str(shown), last)
        if parts:
            os.fchmod(fd, mode)
        return fd
    except BaseException:
        os.close(fd)
        raise


def user_dir(root_fd: int, name: str, uid: int, shown: str = "") -> int:
    """The directory ``name`` below the open directory ``root_fd``, private to user
    ``uid`` (mode 0700, owned by ``uid`` when this process is root), made if missing;
    returns its descriptor (the caller closes it).

    A directory already there is accepted only when it is a directory (not a link)
    owned by ``uid``, or by this process's user, which then hands it to ``uid``.

    Raises:
        UnsafePath: it is a link or a file, or belongs to a third user.
        OSError: the file system refused.
    """
    shown = shown or name
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=root_fd)
    fd = _open_at(root_fd, name, shown)
    try:
        info = os.fstat(fd)
        if info.st_uid != uid:
            if info.st_uid != os.geteuid():
                raise UnsafePath(f"{shown} belongs to uid {info.st_uid}, not to uid {uid}: refused")
            if os.geteuid() == 0:
                os.fchown(fd, uid, -1)
        os.fchmod(fd, 0o700)
        return fd
    except BaseException:
        os.close(fd)
        raise


def remove_below(dir_fd: int, name: str, depth: int = 16) -> None:
    """Remove ``name`` (a file, or a directory and everything in it) below the open
    directory ``dir_fd``, never following a link (a link is removed, not what it points
    to). Nothing happens when it is gone; at most ``depth`` levels are gone into.

    Raises:
        OSError: something could not be removed.
    """
    try:
        os.unlink(name, dir_fd=dir_fd)
        return
    except FileNotFoundError:
        return
    except IsADirectoryError:
        pass
    except OSError as e:
        if e.errno != errno.EISDIR:
            raise
    if depth <= 0:
        raise OSError(errno.ELOOP, f"more than the allowed levels of directories below {name}")
    fd = _open_at(dir_fd, name, name)
    try:
        for entry in os.listdir(fd):
            remove_below(fd, entry, depth - 1)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=dir_fd)


def size_below(dir_fd: int, name: str) -> int:
    """Bytes of the regular files below ``name`` in the open directory ``dir_fd``, links
    not followed (0 when it is gone)."""
    total = 0
    try:
        for _, _, files, fd in os.fwalk(name, dir_fd=dir_fd):
            for f in files:
                with contextlib.suppress(OSError):
                    info = os.stat(f, dir_fd=fd, follow_symlinks=False)
                    if st.S_ISREG(info.st_mode):
                        total += info.st_size
    except OSError:
        pass
    return total
