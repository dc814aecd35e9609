"""The demo's Slurm spawner: :class:`~hub_spawner.slurm.VGPUSlurmSpawner` for demo users
who are not Unix accounts, on a test cluster (``scripts/slurm-cluster``)."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

from traitlets import Bool, Unicode, default

from ..slurm import VGPUSlurmSpawner
from . import system_user


class DemoSlurmSpawner(VGPUSlurmSpawner):
    """Submits every demo user's job as a system account of that user's own
    (``accounts_per_user``: :func:`.system_user.account_name`, made when missing), as a
    real site's Hub submits jobs as its users (batchspawner's ``sudo -E -u {username}``;
    here ``setpriv``, which every Debian has), with the job's folder under
    ``home_template``, made here and owned by the account. Without ``accounts_per_user``,
    as the Hub's own account."""

    home_template = Unicode(
        "", help="The folder of a user's jobs (their output and working directory), '{username}' replaced."
    ).tag(config=True)

    accounts_per_user = Bool(
        False,
        help="""Submit each user's job as a system account of that user's own, made when
        missing (the Hub must be root). False: as the Hub's own account.""",
    ).tag(config=True)

    accounts_file = Unicode(
        "", help="A file listing the system accounts this demo made, one a line (scripts/demo clean)."
    ).tag(config=True)

    def account(self) -> pwd.struct_passwd | None:
        """This user's system account (made when missing), or None without
        ``accounts_per_user``.

        Raises:
            RuntimeError: it cannot be made (the message is shown on the spawn page).
        """
        if not self.accounts_per_user:
            return None
        name = system_user.account_name(self.user.name)
        record = Path(self.accounts_file) if self.accounts_file else None
        account = system_user.ensure(name, record=record)
        if account is None:
            raise RuntimeError(f"cannot create the system account {name} for {self.user.name}")
        return account

    @default("exec_prefix")
    def _demo_exec_prefix(self):
        account = self.account()
        if account is None:
            return ""
        # sbatch, squeue and scancel as the user, with the Hub's environment (SLURM_CONF)
        return (
            f"setpriv --reuid={account.pw_uid} --regid={account.pw_gid} --init-groups --"
            if os.geteuid() == 0
            else ""
        )

    @default("req_homedir")
    def _demo_homedir(self):
        home = self.home_template.format(username=self.user.name)
        os.makedirs(home, mode=0o700, exist_ok=True)
        account = self.account()
        if account is not None:
            os.chown(home, account.pw_uid, account.pw_gid)
        return home

    def user_env(self, env):
        account = self.account()
        env["USER"] = account.pw_name if account is not None else self.user.name
        env["HOME"] = self.req_homedir
        return env
