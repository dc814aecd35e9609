"""Whole-run cleanup shared by every test directory."""

import os


def pytest_sessionfinish(session, exitstatus):
    """Remove the tests' top cgroup (:data:`.server_process.TEST_CGROUP`) once the whole
    run is over; imported here, so that no test session starts with more imports."""
    if hasattr(session.config, "workerinput") or os.geteuid() != 0:
        return  # an xdist worker (the controller ends last), or no cgroups were made
    from jupyter_vgpu.host import cgroups
    from jupyter_vgpu.testing.server_process import TEST_CGROUP

    for mount in cgroups.mounts():
        top = mount.directory(TEST_CGROUP)
        if top is not None and top.is_dir():
            try:
                top.rmdir()
            except OSError:
                pass  # still in use: a Hub's servers kept on purpose, or another run's
