"""What the Hub page says about how users' processes are kept apart on this host: whether
each server has a cgroup of its own (by which the node arbiter knows its every process,
daemons included) and whether users' servers run as accounts of their own (the Linux
kernel lets one account signal, trace and read the memory of its own processes only:
users sharing an account can read each other's kernels, paused data included)."""

from __future__ import annotations

import os
import pwd
from typing import Any

from .server_cgroup import host_status


def _uid(pid: int | None) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid if pid else None
    except OSError:
        return None


def _account(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def summary(spawner_class, config, running: list, log) -> dict[str, Any]:
    """The page's "Isolation on this host" section.

    Args:
        spawner_class: the Hub's spawner class.
        config: the Hub's config.
        running: ``(user, spawner)`` of every running server with a slice.
        log: where a failed cgroup probe is said once.

    Returns:
        ``{"cgroups": {"mode", "describe", "problem"}, "shared": [{"account", "users"}],
        "root": [users], "warning": str | None}``: ``shared`` lists accounts that run
        servers of several users (by the servers' processes, or by the spawner's own
        rule when none runs yet), ``root`` the users whose server runs as root.
    """
    by_uid: dict[int, set[str]] = {}
    for user, spawner in running:
        uid = _uid(getattr(spawner, "pid", None))
        if uid is not None:
            by_uid.setdefault(uid, set()).add(user.name)
    shared = [
        {"account": _account(uid), "users": sorted(names)} for uid, names in by_uid.items() if len(names) > 1
    ]
    root = sorted(by_uid.get(0, ()))
    rule = any(getattr(s, "vgpu_shared_account", False) for _, s in running)
    if not running:
        rule = getattr(spawner_class, "vgpu_shared_account", False) is True
        if spawner_class.__name__ == "DemoSpawner":
            rule = not config.DemoSpawner.get("accounts_per_user", False)
    warning = None
    if shared or rule:
        warning = (
            "Several users' servers run as one Unix account here"
            + (
                f" ({', '.join(s['account'] + ': ' + ', '.join(s['users']) for s in shared)})"
                if shared
                else ""
            )
            + ": each of them can signal, trace and read the memory of the others' kernels, paused data "
            "included. Give each user an account of their own (VGPUSpawner, or the demo run as root)."
        )
    return {
        "cgroups": host_status(spawner_class, config, log),
        "shared": shared,
        "root": root,
        "warning": warning,
    }
