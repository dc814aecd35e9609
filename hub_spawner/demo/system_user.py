"""The demo's unprivileged system account: created when missing, checked before use.

When the demo Hub runs as root (containers, CI), every demo user's server runs as one
dedicated system user instead of root, so that a demo login cannot read the Hub's
cookie secret or database, or act as root on the machine.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

#: The account demo servers run as.
NAME = "vgpu-demo"
#: How it is created: a system account with no home and no login shell.
USERADD = [
    "useradd",
    "--system",
    "--no-create-home",
    "--home-dir",
    "/nonexistent",
    "--shell",
    "/usr/sbin/nologin",
]


def ensure(name: str = NAME) -> pwd.struct_passwd | None:
    """The system account ``name``, created (``useradd --system``, no login shell, no
    home) when missing and this process is root; None when it is missing and cannot be
    created."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    if os.geteuid() != 0 or not shutil.which("useradd"):
        return None
    subprocess.run(
        [*USERADD, name],
        check=False,
        capture_output=True,
    )
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


def cannot_run_servers(account: pwd.struct_passwd, workdir: Path) -> str | None:
    """Why ``account`` cannot run a single-user server with this Python from ``workdir``
    (e.g. the virtual environment lives in a directory it cannot read), or None when it
    can."""
    try:
        result = subprocess.run(
            [sys.executable, "-c", "import jupyterhub.singleuser, jupyter_vgpu.server"],
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
