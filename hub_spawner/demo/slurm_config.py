# The demo Hub on a Slurm cluster: jupyterhub_config.py beside this file, with every
# user's server a Slurm batch job on a node of the cluster scripts/slurm-cluster runs,
# its slice placed on the nodes' simulated GPUs, and node arbiters on the nodes.
#
#   bash scripts/slurm-cluster start /tmp/vgpu-slurm
#   JUPYTER_VGPU_DEMO_SLURM=/tmp/vgpu-slurm/cluster.json jupyterhub -f hub_spawner/demo/slurm_config.py
#
# Environment: that of jupyterhub_config.py, and
#   JUPYTER_VGPU_DEMO_SLURM       the cluster's description (DIR/cluster.json of scripts/slurm-cluster)
#   JUPYTER_VGPU_DEMO_NODE_TOKEN  the node arbiters' token (service vgpu-nodes)
#   JUPYTER_VGPU_DEMO_PLACEMENT   binpack (default) or spread
#   JUPYTER_VGPU_DEMO_SLURM_PENDING  seconds a job may pend before the spawn gives up (default 60)
#   JUPYTER_VGPU_DEMO_SLURM_PROFILES the spawn form's profiles, as JSON (profile_list)
#
# The test cluster runs every job as root (the Hub's own account): this Python may live
# where other accounts cannot run it (a virtual environment made from a Python under
# /root). On a real cluster jobs run as each user's Unix account (batchspawner's
# `sudo -E -u {username}`), from a Python every node can read.
import json
import os
import sys
from pathlib import Path

import hub_spawner

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file
load_subconfig(str(Path(__file__).with_name("jupyterhub_config.py")))  # noqa: F821

cluster = json.loads(Path(os.environ["JUPYTER_VGPU_DEMO_SLURM"]).read_text())
# No arbiter beside the Hub: one per node instead (scripts/slurm-cluster arbiters), whose
# token setup_slurm registers (in place of the demo's Kubernetes node service).
others = (hub_spawner.ARBITER_SERVICE, "vgpu-node")
c.JupyterHub.services = [s for s in c.JupyterHub.services if s.get("name") not in others]
c.JupyterHub.load_roles = [r for r in c.JupyterHub.load_roles if r.get("name") not in others]
c.VGPUHub.arbiter_socket = ""
hub_spawner.setup_slurm(c, node_token=os.environ.get("JUPYTER_VGPU_DEMO_NODE_TOKEN"))
c.JupyterHub.spawner_class = "hub_spawner.demo.slurm.DemoSlurmSpawner"

# The nodes' servers reach the Hub's API on the cluster's bridge.
c.JupyterHub.hub_ip = cluster["host_address"]
state = Path(os.environ.get("JUPYTER_VGPU_DEMO_DIR", ".vgpu-demo")).resolve()
c.DemoSlurmSpawner.home_template = str(state / "users" / "{username}")
c.SlurmSpawner.req_partition = cluster["partition"]
bindir = Path(sys.executable).parent
c.Spawner.cmd = [str(bindir / "jupyterhub-singleuser")]
c.SlurmSpawner.batchspawner_singleuser_cmd = str(bindir / "batchspawner-singleuser")
# sbatch and the job need the cluster's configuration (SLURM_CONF) and this PATH
c.Spawner.env_keep = ["JUPYTERHUB_SINGLEUSER_APP", "PATH", "LANG", "SLURM_CONF"]
if os.geteuid() == 0:
    c.Spawner.args = ["--ServerApp.allow_root=True"]
c.SlurmSpawner.startup_poll_interval = 0.25
c.SlurmSpawner.start_timeout = 120
c.VGPUSlurmSpawner.vgpu_arbiter_socket = f"{cluster['dir']}/arbiter/{{node}}/arbiter.sock"
c.VGPUSlurmSpawner.vgpu_pending_timeout = float(os.environ.get("JUPYTER_VGPU_DEMO_SLURM_PENDING", "60"))
# 1 GiB per shard: the nodes' simulated GPUs have shards_per_gpu shards each
c.GPUInventory.simulated_memory = cluster["shards_per_gpu"] * 2**30
c.GPUInventory.simulated_name = f"Simulated GPU, {cluster['shards_per_gpu']} GiB (Slurm GRES)"
c.VGPUHub.placement = os.environ.get("JUPYTER_VGPU_DEMO_PLACEMENT", "binpack")
profiles = os.environ.get("JUPYTER_VGPU_DEMO_SLURM_PROFILES")
if profiles:  # the spawn form's choices, as JSON (VGPUSlurmSpawner.profile_list)
    c.VGPUSlurmSpawner.profile_list = json.loads(profiles)
