"""Which processes of no server may use a managed card: the allowlist, judged by the process.

A program's name says nothing about the code its process runs: ``LD_PRELOAD`` (or
``LD_AUDIT``, ``LD_LIBRARY_PATH``, a ``dlopen`` of the user's) puts a user's library into
a root-owned ``nvidia-smi``, and ``ptrace`` puts code into a running one. So a process is
allowed for its executable (``ArbiterApp.allowed_executables``) only when:

- its executable is the one named (an absolute path), or has the name given and lies in a
  directory only root may write, and is root's and writable by root alone;
- no process traces it (``TracerPid`` 0 in ``/proc/<pid>/status``);
- every executable mapping of its memory (``/proc/<pid>/maps``) comes from a file that is
  root's and writable by root alone, in a directory likewise (the kernel's ``[vdso]`` and
  ``[vsyscall]`` aside): a library of a user's, or code written into anonymous memory,
  makes the process a user's, whatever its name.

A process in one of ``ArbiterApp.allowed_cgroups`` is allowed whatever it runs: users
cannot move processes into a cgroup of root's (:mod:`jupyter_vgpu.host.cgroups`), so where a monitoring
agent has a cgroup of its own (a systemd service), naming the cgroup is the firmer choice.

What ``/proc`` cannot tell about (a process gone, or unreadable) is allowed: unknown,
never acted on.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable

from jupyter_vgpu.host import cgroups, procs

#: Executable mappings the Linux kernel makes itself, in every process.
KERNEL_MAPPINGS = frozenset({"[vdso]", "[vsyscall]", "[uprobes]"})


def root_only(path: str) -> bool:
    """Whether the file ``path`` and the directory holding it are root's and writable by
    root alone (links followed: the files they lead to are judged)."""
    try:
        for p in (os.path.dirname(path), path):
            info = os.stat(p)
            if info.st_uid != 0 or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return False
    except OSError:
        return False
    return True


def _traced(pid: int) -> bool | None:
    words = procs.status_field(pid, "TracerPid")
    try:
        return int(words[0]) != 0
    except (TypeError, ValueError, IndexError):
        return None


def foreign_code(pid: int) -> str | None:
    """The first code mapped executable in process ``pid`` that is not root's alone (a
    file's path, or ``anonymous``), ``"traced"`` when a process traces it, None when all
    of it is root's; ``"unknown"`` when ``/proc`` cannot say."""
    traced = _traced(pid)
    if traced is None:
        return "unknown"
    if traced:
        return "traced"
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return "unknown"
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or "x" not in fields[1]:
            continue
        path = fields[5].strip() if len(fields) > 5 else ""
        if path in KERNEL_MAPPINGS:
            continue
        if not path.startswith("/"):
            return "anonymous"
        if not root_only(path.removesuffix(" (deleted)")) or path.endswith(" (deleted)"):
            return path
    return None


def judge(pid: int, executables: Iterable[str], allowed_cgroups: Iterable[str]) -> tuple[bool, str]:
    """``(allowed, why)`` for process ``pid`` using a managed card outside every server.

    Args:
        pid: the process.
        executables: ``ArbiterApp.allowed_executables`` (absolute paths, or bare names of
            programs in root-only directories).
        allowed_cgroups: ``ArbiterApp.allowed_cgroups`` (``PATH`` or ``HIERARCHY:PATH``).
    """
    try:
        exe = os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
    except FileNotFoundError:
        return True, "gone"
    except OSError:
        exe = ""
    held = list(allowed_cgroups)
    if held:
        memberships = cgroups.of(pid)
        if memberships is None:
            return True, "gone"
        for entry in held:
            try:
                if cgroups.Cgroup.parse_name(entry).holds(memberships):
                    return True, f"in the allowed cgroup {entry}"
            except ValueError:
                continue
    named = [
        entry
        for entry in executables
        if exe and (exe == entry or ("/" not in entry and os.path.basename(exe) == entry))
    ]
    if not named:
        return False, f"{exe or '?'} is not on the allowlist"
    if not root_only(exe):
        return False, f"{exe} is not root's alone"
    foreign = foreign_code(pid)
    if foreign == "unknown":
        return True, "unknown"
    if foreign is not None:
        what = (
            "a process traces it" if foreign == "traced" else f"it runs code that is not root's ({foreign})"
        )
        return False, f"{exe} is on the allowlist, but {what}"
    return True, f"{exe} is on the allowlist"
