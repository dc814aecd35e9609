"""The demo's Slurm spawner: :class:`~hub_spawner.slurm.VGPUSlurmSpawner` for demo users
who are not Unix accounts, on a test cluster (``scripts/slurm-cluster``)."""

from __future__ import annotations

from traitlets import Unicode, default

from ..slurm import VGPUSlurmSpawner


class DemoSlurmSpawner(VGPUSlurmSpawner):
    """Submits every demo user's job as the Hub's own account (batchspawner's default is
    ``sudo -E -u <user>``, for users who are Unix accounts of the cluster), with the job's
    folder under ``home_template``, created here."""

    home_template = Unicode(
        "", help="The folder of a user's jobs (their output and working directory), '{username}' replaced."
    ).tag(config=True)

    @default("exec_prefix")
    def _demo_exec_prefix(self):
        return ""

    @default("req_homedir")
    def _demo_homedir(self):
        import os

        home = self.home_template.format(username=self.user.name)
        os.makedirs(home, mode=0o700, exist_ok=True)
        return home

    def user_env(self, env):
        env["USER"] = self.user.name
        env["HOME"] = self.req_homedir
        return env
