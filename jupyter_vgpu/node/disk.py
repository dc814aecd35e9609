"""The disk tier's directories on the node: one per kernel, readable by its user and the arbiter.

Layout under ``ArbiterApp.disk_dir`` (the root, mode 0711: anyone may pass through it,
nobody but the arbiter may list it)::

    <root>/<uid>/                      mode 0700, owned by the user (chown when the arbiter is root)
    <root>/<uid>/kernel-<pid>-<start>/ made by the kernel, mode 0700; its files 0600

``<start>`` is the process's start time (``/proc/<pid>/stat`` field 22, clock ticks after
boot), so a PID the system hands out again never meets another process's files. Only
the kernel's user and the arbiter (root, or the same user) can read them. A kernel that
dies (killed, at any step) leaves its directory behind; :func:`sweep` removes every
directory whose process no longer exists, at the arbiter's start, when a kernel's
connection ends, and every few seconds.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("jupyter_vgpu.node")


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks after boot, or None when it is
    gone (a zombie, killed and not yet reaped by its parent, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def default_root() -> str:
    """``/var/tmp/jupyter-vgpu`` for root, ``/var/tmp/jupyter-vgpu-<uid>`` for anyone else:
    a disk-backed directory (``/run`` and often ``/tmp`` are memory)."""
    uid = os.getuid()
    return "/var/tmp/jupyter-vgpu" if uid == 0 else f"/var/tmp/jupyter-vgpu-{uid}"


def user_dir(root: str | Path, uid: int) -> Path:
    """``<root>/<uid>``, made (0700, owned by ``uid`` when this process is root) if needed.

    Raises:
        OSError: it cannot be made, or ``root`` is writable by every user (anyone could
            then put a directory of theirs in a user's place).
    """
    root = Path(root)
    root.mkdir(mode=0o711, parents=True, exist_ok=True)
    if root.stat().st_mode & 0o002:
        raise OSError(f"the disk tier's directory {root} is writable by every user; give it one of its own")
    path = root / str(uid)
    path.mkdir(mode=0o700, exist_ok=True)
    if os.getuid() == 0 and path.stat().st_uid != uid:
        os.chown(path, uid, -1)
    os.chmod(path, 0o700)
    return path


def kernel_dir(root: str | Path, uid: int, pid: int) -> str | None:
    """The disk tier directory of kernel ``pid`` of user ``uid`` (not made here: the
    kernel makes it), or None when the process is gone."""
    start = start_time(pid)
    return None if start is None else str(Path(root) / str(uid) / f"kernel-{pid}-{start}")


def owner_alive(path: Path) -> bool:
    """True when the process a ``kernel-<pid>-<start>`` directory belongs to still exists."""
    try:
        _, pid, start = path.name.split("-")
        return start_time(int(pid)) == int(start)
    except ValueError:
        return True  # not one of ours: leave it alone


def size(path: str | Path) -> int:
    """Bytes of the files under ``path`` (0 when it is gone)."""
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except OSError:
                pass
    return total


def remove(path: str | Path) -> None:
    """Remove a kernel's directory and everything in it (no error when it is gone)."""
    shutil.rmtree(path, ignore_errors=True)


def sweep(root: str | Path) -> list[str]:
    """Remove the directories of kernels that no longer exist; returns the paths removed."""
    removed = []
    root = Path(root)
    try:
        users = [p for p in root.iterdir() if p.is_dir()]
    except OSError:
        return removed
    for user in users:
        try:
            kernels = [p for p in user.iterdir() if p.name.startswith("kernel-")]
        except OSError:
            continue
        for path in kernels:
            if not owner_alive(path):
                remove(path)
                removed.append(str(path))
    return removed


def free_bytes(root: str | Path) -> int | None:
    """Bytes free for an unprivileged user on the file system of ``root``, or None."""
    try:
        st = os.statvfs(root)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
