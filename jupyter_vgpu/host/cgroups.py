"""Control groups: which cgroup a process is in, and whether one cgroup lies within another.

A process cannot leave its cgroup unless it may write the ``cgroup.procs`` file of the
cgroup it moves to and of their common ancestor: with the directories owned by root, a
user's process stays where it was put, whatever it does to its process tree (a double
fork, ``setsid``, ``nohup … & disown``, a daemonizing tool, re-parenting to init). So a
server put in a cgroup of its own (:mod:`hub_spawner.server_cgroup` on one host, the
pod's on Kubernetes) owns every process in that cgroup and below it, firmly.

``/proc/<pid>/cgroup`` has one line per hierarchy, ``ID:CONTROLLERS:PATH``:
``0::/jupyter-vgpu/ada-1a2b`` for the unified hierarchy (cgroup v2), and on cgroup v1
``4:memory:/x`` or ``9:name=systemd:/x`` for each v1 hierarchy (a "hybrid" host has
both). Paths are relative to the root of the hierarchy as this process's cgroup
namespace sees it. A hierarchy is named here by :data:`V2` for the unified one and by
its controllers (``"pids"``, ``"cpu,cpuacct"``) or name (``"name=systemd"``) for a v1
one; each controller of a v1 line is also a name of that line (``"cpu"``, ``"cpuacct"``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

#: The name of the unified (cgroup v2) hierarchy.
V2 = "cgroup2"


def parse(text: str) -> dict[str, str]:
    """The cgroup of each hierarchy in a ``/proc/<pid>/cgroup`` text.

    ``"0::/a/b\\n4:cpu,cpuacct:/c\\n"`` -> ``{"cgroup2": "/a/b", "cpu,cpuacct": "/c",
    "cpu": "/c", "cpuacct": "/c"}``. Lines that are not ``ID:CONTROLLERS:PATH`` are skipped.
    """
    found: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        _, controllers, path = parts
        if parts[0] == "0" and controllers == "":
            found[V2] = path
            continue
        found[controllers] = path
        for name in controllers.split(","):
            found.setdefault(name, path)
    return found


def of(pid: int, proc: str = "/proc") -> dict[str, str] | None:
    """The cgroups of process ``pid`` (:func:`parse`), or None when it is gone."""
    try:
        with open(f"{proc}/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
            return parse(f.read())
    except OSError:
        return None


def within(inner: str, outer: str) -> bool:
    """Whether cgroup path ``inner`` is ``outer`` or lies below it (``/a/b`` is within
    ``/a``, ``/ab`` is not; everything is within ``/``)."""
    if outer == "/" or inner == outer:
        return True
    return inner.startswith(outer.rstrip("/") + "/")


@dataclasses.dataclass(frozen=True)
class Cgroup:
    """A cgroup: its hierarchy (:data:`V2` or a v1 hierarchy's name) and its path there.

    Its text form (:meth:`__str__`, :meth:`parse_name`) is the path for the unified
    hierarchy and ``HIERARCHY:PATH`` for a v1 one (``"pids:/jupyter-vgpu/ada-1a2b"``).
    """

    hierarchy: str
    path: str

    def __str__(self) -> str:
        return self.path if self.hierarchy == V2 else f"{self.hierarchy}:{self.path}"

    @classmethod
    def parse_name(cls, text: str) -> Cgroup:
        """The cgroup named by ``text`` (``"/a/b"`` or ``"pids:/a/b"``).

        Raises:
            ValueError: the path is not absolute, or holds ``..``.
        """
        hierarchy, _, path = text.rpartition(":") if not text.startswith("/") else ("", "", text)
        if not path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"a cgroup is an absolute path, optionally after 'HIERARCHY:', not {text!r}")
        return cls(hierarchy or V2, path)

    def holds(self, memberships: dict[str, str] | None) -> bool:
        """Whether a process with these cgroups (:func:`of`) is in this cgroup or below it."""
        if not memberships:
            return False
        path = memberships.get(self.hierarchy)
        return path is not None and within(path, self.path)


@dataclasses.dataclass(frozen=True)
class Mount:
    """Where a hierarchy is mounted (a line of ``/proc/self/mountinfo``).

    Attributes:
        hierarchy: :data:`V2`, or the v1 hierarchy's name (its controllers, or ``name=…``).
        root: the cgroup path the mount shows at its top (``/`` unless a sub-tree is
            bind-mounted, as in some containers).
        mountpoint: where it is mounted (``/sys/fs/cgroup``, ``/sys/fs/cgroup/unified``,
            ``/sys/fs/cgroup/pids``).
        writable: mounted read-write.
    """

    hierarchy: str
    root: str
    mountpoint: str
    writable: bool

    def directory(self, path: str) -> Path | None:
        """The directory of cgroup ``path`` under this mount; None when the mount does
        not show it (``path`` is not within :attr:`root`)."""
        if not within(path, self.root):
            return None
        rest = path[len(self.root.rstrip("/")) :].lstrip("/")
        return Path(self.mountpoint, rest) if rest else Path(self.mountpoint)


def _unescape(field: str) -> str:
    """A mountinfo field with its octal escapes (``\\040`` for a space) undone."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mounts(mountinfo: str) -> list[Mount]:
    """The cgroup mounts in a ``/proc/self/mountinfo`` text, in its order.

    Each line: ``ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL…] - FSTYPE SOURCE
    SUPER_OPTIONS`` (proc(5)); a v1 hierarchy's controllers and ``name=`` are among its
    super options.
    """
    mounts = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 6 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        writable = "rw" in fields[5].split(",")
        if tail[0] == "cgroup2":
            hierarchy = V2
        else:
            known = {"rw", "ro", "noexec", "nosuid", "nodev", "relatime", "noatime", "clone_children"}
            options = [
                o for o in tail[2].split(",") if (o not in known and "=" not in o) or o.startswith("name=")
            ]
            options = [o for o in options if not o.startswith(("release_agent", "xattr", "cpuset_v2_mode"))]
            hierarchy = ",".join(options)
        mounts.append(Mount(hierarchy, _unescape(fields[3]), _unescape(fields[4]), writable))
    return mounts


def mounts(proc: str = "/proc") -> list[Mount]:
    """This process's cgroup mounts (:func:`parse_mounts` of ``/proc/self/mountinfo``)."""
    try:
        with open(f"{proc}/self/mountinfo", encoding="utf-8", errors="replace") as f:
            return parse_mounts(f.read())
    except OSError:
        return []


def find_mount(hierarchy: str, found: list[Mount] | None = None) -> Mount | None:
    """The mount of ``hierarchy`` (:data:`V2`, a v1 hierarchy's name or one of its
    controllers), or None where it is not mounted."""
    for m in found if found is not None else mounts():
        if m.hierarchy == hierarchy or hierarchy in m.hierarchy.split(","):
            return m
    return None


def procs(directory: str | os.PathLike) -> list[int]:
    """The PIDs in the cgroup at ``directory`` (its ``cgroup.procs``); [] when it is gone."""
    try:
        with open(Path(directory, "cgroup.procs")) as f:
            return [int(line) for line in f if line.strip()]
    except OSError:
        return []


def try_remove(directory: str | os.PathLike) -> bool:
    """Remove a cgroup's directory: True once it is gone (removed now or before), False
    while processes are still in it (the kernel refuses with ``EBUSY``) or it cannot be
    removed now; callers retry, ending what is left between tries."""
    try:
        os.rmdir(directory)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True
