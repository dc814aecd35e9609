# The demo Hub on a Slurm cluster: every user's server a Slurm batch job on a node of the
# cluster scripts/slurm-cluster runs, submitted as that user's own system account, its
# slice placed on the nodes' simulated GPUs, and a node arbiter on every node.
#
#   bash scripts/demo slurm       # runs the cluster, this Hub and the node arbiters;
#                                 # Ctrl-C or `bash scripts/demo stop` stops it all
#
# By hand (as root, in the checkout; scripts/demo slurm does exactly this):
#   bash scripts/slurm-cluster start .vgpu-demo-slurm/cluster
#   JUPYTER_VGPU_DEMO_SLURM=.vgpu-demo-slurm/cluster/cluster.json \
#     .venv/bin/jupyterhub -f hub_spawner/demo/slurm_config.py
#
# Environment: that of jupyterhub_config.py beside this file (its state directory
# defaults to ./.vgpu-demo-slurm here, its own), and
#   JUPYTER_VGPU_DEMO_SLURM       the cluster's description (DIR/cluster.json of scripts/slurm-cluster)
#   JUPYTER_VGPU_DEMO_NODE_TOKEN  the node arbiters' token (service vgpu-nodes)
#   JUPYTER_VGPU_DEMO_PLACEMENT   binpack (default) or spread
#   JUPYTER_VGPU_DEMO_SLURM_PENDING  seconds a job may pend before the spawn gives up (default 60)
#   JUPYTER_VGPU_DEMO_SLURM_PROFILES the spawn form's profiles, as JSON (profile_list)
#
# Jobs are submitted as each user's own system account (vgpu-<name>, made by the demo as
# root), as a real site's Hub submits them as its users (batchspawner's exec_prefix,
# `sudo -E -u {username}`), with a Python every account can run (the system's Python over
# this environment's packages where this one lives under /root). Where no such Python
# exists, jobs run as root and the log says why. The settings are in
# hub_spawner/demo/settings.py.
from hub_spawner.demo import settings

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file
settings.slurm(c)
