# The demo Hub of jupyter-vgpu: real JupyterHub, real configurable-http-proxy,
# JupyterLab, SQLite, and simulated GPUs when NVML finds none.
#
#   bash scripts/demo            # runs this; Ctrl-C or `bash scripts/demo stop` stops it all
#   jupyterhub -f hub_spawner/demo/jupyterhub_config.py
#
# It listens on 127.0.0.1 only: anyone who can reach it and knows the shared password
# runs code on this machine. Run as root, it runs each user's server as a system account
# of that user's own (vgpu-<name>, created at first spawn), in a cgroup of its own. The
# settings are in hub_spawner/demo/settings.py; its log says what it does (simulated
# GPUs and their size, which account servers run as).
#
# Environment (all optional):
#   JUPYTER_VGPU_DEMO_PASSWORD  shared password of every demo user (default: vgpu-demo)
#   JUPYTER_VGPU_DEMO_DIR       state directory: database, cookie secret, homes (default: ./.vgpu-demo)
#   JUPYTER_VGPU_DEMO_PORT      public port on 127.0.0.1 (default: 8000; the Hub's API is on
#                               this + 81 and the proxy's on this + 1, unless set below)
#   JUPYTER_VGPU_DEMO_HUB_PORT, JUPYTER_VGPU_DEMO_PROXY_PORT  those two ports
#   JUPYTER_VGPU_DEMO_KEEP_SERVERS "1": users' servers keep running when the Hub stops, and
#                               the Hub started again adopts them (default: it stops them)
#   JUPYTER_VGPU_DEMO_SIMULATE  "1": simulate GPUs; "0": real GPUs only; unset: simulate
#                               when no NVIDIA driver answers (said in the log)
#   JUPYTER_VGPU_DEMO_GPU_MEMORY memory of each simulated GPU, e.g. "1G" (default: 80G)
#   JUPYTER_VGPU_DEMO_MIG       simulated GPU 1 in MIG mode with these instances,
#                               e.g. "3g.40gb,2g.20gb,1g.10gb,1g.10gb"
#   JUPYTER_VGPU_DEMO_ISOLATION isolation backend of shared GPUs: time-slicing (default) or mps
#   JUPYTER_VGPU_DEMO_NODE_TOKEN  a token for Kubernetes node arbiters' reports (service vgpu-node)
#   JUPYTER_VGPU_DEMO_ARBITER_TOKEN the node arbiter runs outside the Hub with this token (as a
#                               real host's unit runs it, docs/admin.md): start it yourself, on
#                               <state>/arbiter/arbiter.sock (default: the Hub runs it)
#   JUPYTER_VGPU_DEMO_CGROUP_PARENT the cgroup servers' cgroups go under (default: one of this
#                               demo's own, /jupyter-vgpu-demo/<state>-<hash>)
#   JUPYTER_VGPU_DEMO_SERVER_PORTS  the ports users' servers get, "LOW-HIGH" (default: 20000-29999)
#   JUPYTER_VGPU_DEMO_ACCOUNT_PREFIX the system accounts' prefix, when the Hub runs as root
#                               (default: vgpu-): demo Hubs side by side whose users must not
#                               share an account
from hub_spawner.demo import settings

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file
settings.local(c)
