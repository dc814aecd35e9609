"""The demo's spawner: ``VGPUSimpleSpawner`` that runs servers as an unprivileged account."""

from __future__ import annotations

import os
import pwd

from traitlets import Unicode

from ..spawner import VGPUSimpleSpawner


class DemoSpawner(VGPUSimpleSpawner):
    """Every demo user's server runs as the system account ``run_as`` (the Hub must be
    root to switch to it), in ``home_dir_template``, created for it; with ``run_as``
    empty, as the Hub's own user, like its base class."""

    run_as = Unicode(
        "",
        help="""System account every server runs as (the Hub must run as root). Empty: the
        Hub's own user, as SimpleLocalProcessSpawner does.""",
    ).tag(config=True)

    def make_preexec_fn(self, name):
        if not self.run_as:
            return super().make_preexec_fn(name)
        account = pwd.getpwnam(self.run_as)
        home = self.home_dir

        def preexec():  # runs in the child, as root, before exec
            os.makedirs(home, mode=0o700, exist_ok=True)
            os.chown(home, account.pw_uid, account.pw_gid)
            os.setgid(account.pw_gid)
            os.initgroups(account.pw_name, account.pw_gid)
            os.setuid(account.pw_uid)
            os.chdir(home)

        return preexec
