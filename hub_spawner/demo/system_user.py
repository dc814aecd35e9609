"""The demo's system accounts: one per demo user, created on first login, checked before use.

When the demo Hub runs as root (containers, CI), each demo user's server runs as a
system account of that user's own, as JupyterHub's ``LocalAuthenticator`` with
``create_system_users`` gives each user one: a demo login cannot read the Hub's cookie
secret or database, act as root, or signal, trace or read another user's kernels (the
Linux kernel allows those only within one account).

Demo user names are anything typed on the login form, so an account's name is made from
the user's name (:func:`account_name`) and never *is* it: ``root`` logs in as the
account ``vgpu-root``.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from jupyter_vgpu.host import procs

#: Accounts' names start with this, so that no demo user gets an existing account.
PREFIX = "vgpu-"
#: The environment variable that sets another prefix (``[a-z][a-z0-9]{0,9}-``): demo Hubs
#: side by side on one host (the tests, in several processes) whose users must not share
#: an account, since each Hub removes the accounts it made when it is cleaned up.
PREFIX_VARIABLE = "JUPYTER_VGPU_DEMO_ACCOUNT_PREFIX"
#: The longest account name ``useradd`` takes.
MAX_NAME = 32
#: How accounts are created: system accounts with no home and no login shell (the demo
#: gives each server its home in the demo's state directory).
USERADD = [
    "useradd",
    "--system",
    "--no-create-home",
    "--home-dir",
    "/nonexistent",
    "--shell",
    "/usr/sbin/nologin",
]
#: The account a Python is tried with before accounts are made (Debian's unprivileged one).
PROBE_ACCOUNT = "nobody"


def account_prefix(value: str | None = None) -> str:
    """The accounts' prefix: ``value``, else :data:`PREFIX_VARIABLE` where set, else
    :data:`PREFIX`.

    Raises:
        ValueError: it is not a lower-case letter, up to 9 more letters or digits, and
            ``-``.
    """
    value = value or os.environ.get(PREFIX_VARIABLE) or PREFIX
    if not re.fullmatch(r"[a-z][a-z0-9]{0,9}-", value):
        raise ValueError(
            f"account prefix {value!r} ({PREFIX_VARIABLE}): expected a lower-case letter, "
            "up to 9 more letters or digits, and '-'"
        )
    return value


def account_name(username: str, prefix: str | None = None) -> str:
    """The system account of demo user ``username``, one per name, never shared.

    A name of lower-case letters, digits and ``-`` that fits gives ``vgpu-<name>``
    (``"ada"`` -> ``"vgpu-ada"``). Any other name gives ``vgpu_``, its first 10
    characters with every other character replaced by ``-``, ``_`` and 16 hex digits of
    its SHA-1 (``"Ada Lovelace"`` -> ``"vgpu_ada-lovela_<16 hex>"``): the two forms never
    meet (``vgpu-`` against ``vgpu_``), and another name with the same digits would need
    a 64-bit SHA-1 collision. At most 32 characters, as ``useradd`` takes. ``vgpu-`` is
    :func:`account_prefix` of ``prefix`` (the second form's ``vgpu`` its first part), and
    a longer one leaves fewer of the name's characters in the second form.

    Raises:
        ValueError: a bad prefix (:func:`account_prefix`).
    """
    first = account_prefix(prefix)
    if re.fullmatch(r"[a-z0-9-]+", username) and len(first + username) <= MAX_NAME:
        return first + username
    clean = re.sub(r"[^a-z0-9-]", "-", username.lower())[: MAX_NAME - len(first) - 17]
    return f"{first[:-1]}_{clean}_{hashlib.sha1(username.encode()).hexdigest()[:16]}"


def ensure(name: str, attempts: int = 20, record: Path | None = None) -> pwd.struct_passwd | None:
    """The system account ``name``, created (``useradd --system``, no login shell, no
    home) when missing and this process is root; None when it is missing and cannot be
    created. ``useradd`` is retried while another one holds the password file's lock.

    Args:
        record: a file that gets the account's name as a line of its own when this call
            creates it (the demo's ``<state>/accounts``, which ``scripts/demo clean``
            removes the accounts of: :func:`remove`).
    """
    made = False  # by this call: useradd ran, and no other process made it meanwhile

    def found() -> pwd.struct_passwd | None:
        try:
            account = pwd.getpwnam(name)
        except KeyError:
            return None
        if made and record is not None:
            with open(record, "a") as f:
                f.write(name + "\n")
        return account

    for _ in range(attempts):
        account = found()
        if account is not None:
            return account
        if os.geteuid() != 0 or not shutil.which("useradd"):
            return None
        done = subprocess.run([*USERADD, name], check=False, capture_output=True, text=True)
        if done.returncode == 9:  # created meanwhile by another process
            continue
        made = True  # 0, or a failure that may have left the account made (a group file locked)
        if done.returncode != 0:
            time.sleep(0.1)  # e.g. 10: /etc/group is locked by another useradd
    return found()


def recorded(record: Path) -> list[str]:
    """The accounts listed in ``record`` (:func:`ensure`), each once, in order."""
    try:
        lines = record.read_text().split()
    except OSError:
        return []
    return list(dict.fromkeys(line for line in lines if line))


def processes_of(uid: int) -> list[int]:
    """The PIDs of the processes running as ``uid`` (real or effective)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if str(uid) in line.split()[1:3]:
                            found.append(int(entry.name))
                        break
        except OSError:
            continue
    return found


def _still_running(uid: int, reaped_within: float = 10.0) -> list[int]:
    """The processes running as ``uid``, once those that have ended are reaped: a process
    just ended (the demo's stop, a cgroup emptied) stays a zombie until its parent, or
    init, reaps it, and ``userdel`` refuses an account any process still names. Waits up
    to ``reaped_within`` seconds while every one left is such a zombie."""
    deadline = time.monotonic() + reaped_within
    busy = processes_of(uid)
    while busy and time.monotonic() < deadline and not any(procs.running(p) for p in busy):
        time.sleep(0.1)
        busy = processes_of(uid)
    return busy


def remove(names: list[str]) -> tuple[list[str], list[str]]:
    """Remove the system accounts ``names`` (``userdel``: the account and its group), each
    where it exists and no process runs as it. Give it only accounts the demo recorded
    as made by itself (:func:`recorded`): an account that was there before stays.

    Returns:
        ``(removed, kept)``: names removed, and ``"name: why not"`` for the others.
    """
    removed, kept = [], []
    for name in names:
        try:
            account = pwd.getpwnam(name)
        except KeyError:
            continue  # gone already
        busy = _still_running(account.pw_uid)
        if busy:
            kept.append(f"{name}: processes {', '.join(map(str, busy[:5]))} still run as it")
            continue
        done = subprocess.run(["userdel", name], check=False, capture_output=True, text=True)
        if done.returncode == 0:
            removed.append(name)
        else:
            kept.append(f"{name}: userdel said {done.stderr.strip() or done.returncode}")
    return removed, kept


def cannot_run_servers(account: pwd.struct_passwd, workdir: Path, python: str = sys.executable) -> str | None:
    """Why ``account`` cannot run a single-user server with ``python`` from ``workdir``
    (e.g. the virtual environment lives in a directory it cannot read), or None when it
    can."""
    try:
        result = subprocess.run(
            [python, "-c", "import jupyterhub.singleuser, jupyter_vgpu.server"],
            user=account.pw_uid,
            group=account.pw_gid,
            extra_groups=[],
            cwd=workdir,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workdir)},
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    if result.returncode != 0:
        return (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
    return None


def shared_python(directory: Path) -> tuple[str | None, str]:
    """A Python that other accounts can run, with this one's packages, for when this
    Python lives where they cannot (a virtual environment made from a Python under
    ``/root``, as pyenv installs it): a virtual environment in ``directory`` made from
    the system's Python of the same version (``/usr/bin/python3.X``: the same ABI, so
    the same compiled packages), whose site directory adds this environment's (a
    ``.pth`` line), and whose ``etc`` and ``share`` are this environment's (Jupyter's
    config and data: the server extension, JupyterLab, the kernel's hook).

    Returns:
        ``(its python, "")``, or ``(None, why not)``.
    """
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    base = Path("/usr/bin", version)
    if not os.access(base, os.X_OK):
        return None, f"no system {version} at {base} to run this environment's packages with"
    site = Path(sysconfig.get_paths()["purelib"])
    python = directory / "bin" / "python3"
    try:
        if not python.exists():
            subprocess.run(
                [str(base), "-m", "venv", "--without-pip", str(directory)],
                check=True,
                capture_output=True,
                text=True,
            )
        own_site = Path(
            subprocess.run(
                [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
        )
        (own_site / "jupyter_vgpu_shared.pth").write_text(f"import site; site.addsitedir({str(site)!r})\n")
        for name in ("etc", "share"):
            link = directory / name
            if not link.is_symlink():
                link.symlink_to(Path(sys.prefix, name))
        for path in [directory, *directory.rglob("*")]:
            if not path.is_symlink():
                path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
    except (OSError, subprocess.CalledProcessError) as e:
        said = getattr(e, "stderr", "") or str(e)
        return None, f"cannot make a Python for other accounts in {directory}: {said.strip()[-300:]}"
    return str(python), ""
