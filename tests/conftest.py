"""Whole-run cleanup shared by every test directory."""

import os

from jupyter_vgpu.testing.server_process import TEST_CGROUP


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput") or os.geteuid() != 0:
        return  # an xdist worker (the controller ends last), or no cgroups were made
    from jupyter_vgpu.host import cgroups

    for mount in cgroups.mounts():
        top = mount.directory(TEST_CGROUP)
        if top is not None and top.is_dir():
            try:
                top.rmdir()
            except OSError:
                pass  # still in use: a Hub's servers kept on purpose, or another run's
