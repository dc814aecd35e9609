"""What the Hub page says about how users' processes are kept apart where their servers
run: whether each server has a cgroup of its own (by which the node arbiter knows its
every process, daemons included) and whether users' servers run as accounts of their
own (the Linux kernel lets one account signal, trace and read the memory of its own
processes only: users sharing an account can read each other's kernels, paused data
included). Local servers run on this host; Slurm jobs run on the cluster's nodes, in the
job's cgroup, as the account Slurm says."""

from __future__ import annotations

from typing import Any

from .server_cgroup import host_status

#: Spawners of the demo whose servers run as one account unless ``accounts_per_user``.
_DEMO_SPAWNERS = ("DemoSpawner", "DemoSlurmSpawner")


def process_account(pid: int | None) -> tuple[int, str] | None:
    """``(uid, name)`` of the account process ``pid`` runs as on this host, or None."""
    import os
    import pwd

    try:
        uid = os.stat(f"/proc/{pid}").st_uid if pid else None
    except OSError:
        return None
    if uid is None:
        return None
    try:
        return uid, pwd.getpwuid(uid).pw_name
    except KeyError:
        return uid, str(uid)


def _account(spawner) -> tuple[int | None, str] | None:
    """The account a running server runs as: its spawner's word where it has one (a Slurm
    job's, from Slurm), else its process's owner here."""
    if hasattr(spawner, "vgpu_account"):
        return spawner.vgpu_account()
    return process_account(getattr(spawner, "pid", None))


def _slurm(spawner_class) -> bool:
    return getattr(spawner_class, "vgpu_kind", "") == "slurm"


def summary(spawner_class, config, running: list, log) -> dict[str, Any]:
    """The page's "Isolation" section.

    Args:
        spawner_class: the Hub's spawner class.
        config: the Hub's config.
        running: ``(user, spawner)`` of every running server with a slice.
        log: where a failed cgroup probe is said once.

    Returns:
        ``{"where": "this host" | "the Slurm nodes", "cgroups": {"mode", "describe",
        "problem"}, "accounts": [{"user", "account"}], "shared": [{"account", "users"}],
        "root": [users], "warning": str | None}``: ``accounts`` names the account each
        running server runs as (where the Hub can tell), ``shared`` the accounts that run
        servers of several users (by the servers, or by the spawner's own rule when none
        runs yet), ``root`` the users whose server runs as root.
    """
    by_uid: dict[int | str, set[str]] = {}
    names: dict[int | str, str] = {}
    accounts = []
    for user, spawner in running:
        account = _account(spawner)
        if account is None:
            continue
        uid, name = account
        key = uid if uid is not None else name
        by_uid.setdefault(key, set()).add(user.name)
        names[key] = name
        accounts.append({"user": user.name, "account": name})
    shared = [{"account": names[k], "users": sorted(v)} for k, v in by_uid.items() if len(v) > 1]
    root = sorted(by_uid.get(0, set()) | by_uid.get("root", set()))
    rule = any(getattr(s, "vgpu_shared_account", False) for _, s in running)
    if not running:
        rule = getattr(spawner_class, "vgpu_shared_account", False) is True
        if spawner_class.__name__ in _DEMO_SPAWNERS:
            rule = not config[spawner_class.__name__].get("accounts_per_user", False)
    slurm = _slurm(spawner_class)
    warning = None
    if shared or rule:
        warning = (
            "Several users' servers run as one Unix account "
            + ("on the nodes" if slurm else "here")
            + (
                f" ({', '.join(s['account'] + ': ' + ', '.join(s['users']) for s in shared)})"
                if shared
                else ""
            )
            + ": each of them can signal, trace and read the memory of the others' kernels, paused data "
            "included. Give each user an account of their own "
            + ("(jobs submitted as each user)." if slurm else "(VGPUSpawner, or the demo run as root).")
        )
    if slurm:
        cgroups = {
            "mode": "slurm",
            "describe": "each server is a Slurm job, its processes in the job's cgroup on its node (Slurm's "
            "proctrack/cgroup), which no process of the job can leave",
            "problem": None,
        }
    else:
        cgroups = host_status(spawner_class, config, log)
    return {
        "where": "the Slurm nodes" if slurm else "this host",
        "cgroups": cgroups,
        "accounts": accounts,
        "shared": shared,
        "root": root,
        "warning": warning,
    }
