"""A Hub started again and the servers its database lists as running: it adopts those
its spawner can (the same server, same process, its kernel's data intact), and ends
those it cannot, saying so, instead of logging them stopped while they run on unmanaged.
Issue 43: the Slurm demo's Hub, on the local demo's database, logged the local servers
"stopped while the Hub was down" and left them running with their cgroups."""

from __future__ import annotations

import os
import sys

import pytest

from jupyter_vgpu.host import cgroups
from jupyter_vgpu.testing.hub_process import CONFIG, HubProcess
from jupyter_vgpu.testing.lab_client import LabClient
from jupyter_vgpu.testing.waiting import wait_for

from .test_demo import gone

#: The demo Hub with another kind of spawner: the Slurm demo's (no cluster needed to
#: load the database).
OTHER_KIND = """
load_subconfig({demo!r})  # noqa: F821
c.JupyterHub.spawner_class = "hub_spawner.demo.slurm.DemoSlurmSpawner"  # noqa: F821
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="per-server cgroups need a root Hub")
def test_a_restarted_hub_adopts_what_it_can_and_ends_what_it_cannot(tmp_path):
    hub = HubProcess("adoption")  # servers outlive the Hub (JUPYTER_VGPU_DEMO_KEEP_SERVERS)
    try:
        hub.start()
        token = hub.user_token("ada")
        lab = LabClient(hub.spawn("ada"), token=token)
        kernel = lab.start_kernel()
        lab.execute(kernel, "kept = 'still here'")
        entry = next(s for s in hub.api("GET", "/vgpu/slices").json() if s["user"] == "ada")
        server = entry["pid"]
        kernel_pid = int(lab.execute(kernel, "import os; print(os.getpid())").strip())
        where = cgroups.Cgroup(entry["cgroup_hierarchy"], entry["cgroup"])
        directory = cgroups.find_mount(where.hierarchy).directory(where.path)

        # the same kind of spawner: adopted, the same process, its kernel as it was
        hub.restart()
        again = next(s for s in hub.api("GET", "/vgpu/slices").json() if s["user"] == "ada")
        assert again["pid"] == server
        assert lab.execute(kernel, "print(kept)").strip() == "still here"
        assert "ada still running" in hub.log_tail(400)

        # another kind: it cannot adopt the server, so it ends it, and says so
        hub.stop_hub()
        assert not gone(server)
        assert not gone(kernel_pid)
        other = tmp_path / "other_kind_config.py"
        other.write_text(OTHER_KIND.format(demo=str(CONFIG)))
        hub.command = [sys.executable, "-m", "jupyterhub", "-f", str(other)]
        hub.start()
        wait_for(lambda: gone(server) and gone(kernel_pid), 30, "ada's server and kernel to be ended")
        wait_for(lambda: not directory.exists(), 15, f"{directory} to be removed")
        log = hub.log_path.read_text()
        assert (
            "jupyter-vgpu: ada's server was started by a local spawner and is still listed as running; this "
            "Hub's slurm spawner cannot adopt it, so it is ended, not left running unmanaged: ended "
        ) in log
        assert f"process(es) in its cgroup {where.path}" in log
        assert "ada's server was ended: this Hub could not adopt it" in log
        assert "ada appears to have stopped while the Hub was down" not in log
        assert not hub.api("GET", "/users/ada").json()["servers"]
    finally:
        hub.shutdown()
