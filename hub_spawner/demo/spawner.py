"""The demo's spawner: ``VGPUSimpleSpawner`` that runs each user's server as that user's
own system account."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

from traitlets import Bool, Unicode

from ..spawner import VGPUSimpleSpawner
from . import system_user


class DemoSpawner(VGPUSimpleSpawner):
    """With ``accounts_per_user`` (the Hub must be root), each demo user's server runs as
    a system account of that user's own (:func:`.system_user.account_name`, created on
    first use), in ``home_dir_template``, created for it and owned by it; without, as the
    Hub's own user, like its base class. Either way in a cgroup of its own."""

    accounts_per_user = Bool(
        False,
        help="""Run each user's server as a system account of that user's own, created
        when missing (the Hub must be root): users cannot signal, trace or read each
        other's processes. False: every server runs as the Hub's own user.""",
    ).tag(config=True)

    accounts_file = Unicode(
        "",
        help="""A file that lists the system accounts this demo made, one a line (the
        demo's <state>/accounts; scripts/demo clean removes them). '': none kept.""",
    ).tag(config=True)

    @property
    def vgpu_shared_account(self) -> bool:
        return not self.accounts_per_user

    def account(self) -> pwd.struct_passwd:
        """This user's system account (created when missing).

        Raises:
            RuntimeError: it cannot be created (the message is shown on the spawn page).
        """
        name = system_user.account_name(self.user.name)
        account = system_user.ensure(name, record=Path(self.accounts_file) if self.accounts_file else None)
        if account is None:
            raise RuntimeError(f"cannot create the system account {name} for {self.user.name}")
        return account

    def cgroup_account(self):
        if not self.accounts_per_user:
            return None
        account = self.account()
        return account.pw_uid, account.pw_gid

    def _make_home(self, account: pwd.struct_passwd) -> None:
        os.makedirs(self.home_dir, mode=0o700, exist_ok=True)
        os.chown(self.home_dir, account.pw_uid, account.pw_gid)
        os.chmod(self.home_dir, 0o700)

    def cgroup_prepare(self) -> None:
        if self.accounts_per_user:
            self._make_home(self.account())

    def make_preexec_fn(self, name):
        if not self.accounts_per_user:
            return super().make_preexec_fn(name)
        account = self.account()
        home = self.home_dir
        host, _ = self.cgroup_host()
        if self.vgpu_cgroup is not None and host is not None and host.mode == "systemd":
            return self.cgroup_prepare  # setpriv drops the privileges inside the scope
        join = super().make_preexec_fn(name) if self.vgpu_cgroup is not None else (lambda: None)

        def preexec():  # runs in the child, as root, before exec
            join()  # into the server's cgroup first (and SimpleLocalProcessSpawner's chdir)
            self._make_home(account)
            os.setgid(account.pw_gid)
            os.initgroups(account.pw_name, account.pw_gid)
            os.setuid(account.pw_uid)
            os.chdir(home)

        return preexec

    def user_env(self, env):
        env = super().user_env(env)
        if self.accounts_per_user:
            env["USER"] = system_user.account_name(self.user.name)
        return env
