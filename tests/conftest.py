"""Whole-run cleanup shared by every test directory."""

import os

TESTS_CGROUP = "/jupyter-vgpu-tests"
"""The cgroup every test's cgroups go under (Hubs' servers, probes). It is left in place
while tests run, since a worker removing it while it is empty races another worker
making a cgroup under it; it is removed here once, at the end of the whole run."""


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput") or os.geteuid() != 0:
        return  # an xdist worker (the controller ends last), or no cgroups were made
    from jupyter_vgpu.host import cgroups

    for mount in cgroups.mounts():
        top = mount.directory(TESTS_CGROUP)
        if top is not None and top.is_dir():
            try:
                top.rmdir()
            except OSError:
                pass  # still in use: a Hub's servers kept on purpose, or another run's
