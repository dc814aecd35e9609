# The demo Hub of jupyter-vgpu: real JupyterHub, real configurable-http-proxy,
# JupyterLab, SQLite, and simulated GPUs when NVML finds none.
#
#   jupyterhub -f hub_spawner/demo/jupyterhub_config.py
#
# It listens on 127.0.0.1 only: anyone who can reach it and knows the shared password
# runs code on this machine. Run as root, it runs each user's server as a system account
# of that user's own (vgpu-<name>, created at first spawn), in a cgroup of its own.
#
# Environment (all optional):
#   JUPYTER_VGPU_DEMO_PASSWORD  shared password of every demo user (default: vgpu-demo)
#   JUPYTER_VGPU_DEMO_DIR       state directory: database, cookie secret, homes (default: ./.vgpu-demo)
#   JUPYTER_VGPU_DEMO_PORT      public port on 127.0.0.1 (default: 8000)
#   JUPYTER_VGPU_DEMO_SIMULATE  "1": simulate GPUs; "0": real GPUs only; unset: simulate
#                               when no NVIDIA driver answers (said in the log)
#   JUPYTER_VGPU_DEMO_GPU_MEMORY memory of each simulated GPU, e.g. "1G" (default: 80G)
#   JUPYTER_VGPU_DEMO_MIG       simulated GPU 1 in MIG mode with these instances,
#                               e.g. "3g.40gb,2g.20gb,1g.10gb,1g.10gb"
#   JUPYTER_VGPU_DEMO_ISOLATION isolation backend of shared GPUs: time-slicing (default) or mps
#   JUPYTER_VGPU_DEMO_NODE_TOKEN  a token for Kubernetes node arbiters' reports (service vgpu-node)
#   JUPYTER_VGPU_DEMO_CGROUP_PARENT the cgroup servers' cgroups go under (default: /jupyter-vgpu)
import logging
import os
import sys
from pathlib import Path

import hub_spawner
from hub_spawner.demo import system_user
from jupyter_vgpu import nvml

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file
log = logging.getLogger("JupyterHub")

os.umask(0o077)  # the Hub's database, cookie secret and logs are readable by the Hub only
state = Path(os.environ.get("JUPYTER_VGPU_DEMO_DIR", ".vgpu-demo")).resolve()
homes = state / "users"
homes.mkdir(parents=True, exist_ok=True)
for directory in (state, homes):
    directory.chmod(0o711)  # servers may pass through to their homes, not list or read
for private in ("jupyterhub.sqlite", "jupyterhub_cookie_secret"):
    if (state / private).exists():
        (state / private).chmod(0o600)
port = int(os.environ.get("JUPYTER_VGPU_DEMO_PORT", "8000"))

# The node arbiter (a managed service) listens in the state directory, so that demo Hubs
# side by side (the tests) each have their own; a socket path has at most 107 bytes.
arbiter_socket = state / "arbiter" / "arbiter.sock"
hub_spawner.setup(c, arbiter_socket=str(arbiter_socket) if len(str(arbiter_socket)) < 100 else None)
# ... and keeps its disk tier (paused kernels moved out of host memory) there too
for service in c.JupyterHub.services:
    if service["name"] == hub_spawner.ARBITER_SERVICE:
        service["command"].append(f"--ArbiterApp.disk_dir={state / 'disk'}")

c.JupyterHub.bind_url = f"http://127.0.0.1:{port}"
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = int(os.environ.get("JUPYTER_VGPU_DEMO_HUB_PORT", port + 81))
c.ConfigurableHTTPProxy.api_url = (
    f"http://127.0.0.1:{int(os.environ.get('JUPYTER_VGPU_DEMO_PROXY_PORT', port + 1))}"
)
c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")
# Keep users' servers (and their kernels) running across a Hub restart; their slices
# come back from the database.
c.JupyterHub.cleanup_servers = False

c.JupyterHub.authenticator_class = "hub_spawner.demo.authenticator.DemoAuthenticator"
c.DemoAuthenticator.password = os.environ.get("JUPYTER_VGPU_DEMO_PASSWORD", "vgpu-demo")
c.Authenticator.allow_all = True
c.Authenticator.admin_users = {"admin"}

# Demo users are not system users: the demo makes each one a system account of their
# own (hub_spawner.demo.system_user) when the Hub is root, and runs their server as it,
# in this very Python, with JupyterLab, in a cgroup of its own.
c.JupyterHub.spawner_class = "hub_spawner.demo.spawner.DemoSpawner"
c.SimpleLocalProcessSpawner.home_dir_template = str(homes / "{username}")
python = sys.executable
c.Spawner.default_url = "/lab"
# Show the spawn page (with where the vGPU slice went) at once instead of a blank wait.
c.JupyterHub.tornado_settings = {"slow_spawn_timeout": 0}
c.Spawner.http_timeout = 60
c.Spawner.start_timeout = 120
if os.environ.get("JUPYTER_VGPU_DEMO_CGROUP_PARENT"):
    c.DemoSpawner.cgroup_parent = os.environ["JUPYTER_VGPU_DEMO_CGROUP_PARENT"]
if os.geteuid() == 0:
    probe = system_user.ensure(system_user.PROBE_ACCOUNT)
    why_not = (
        f"no account {system_user.PROBE_ACCOUNT}"
        if probe is None
        else system_user.cannot_run_servers(probe, homes)
    )
    if why_not is not None and probe is not None:
        # This Python lives where other accounts cannot run it (a virtual environment
        # made from a Python under /root): run servers with the system's Python of the
        # same version over this environment's packages, if it has one.
        shared, why_shared = system_user.shared_python(state / "python")
        if shared is not None and system_user.cannot_run_servers(probe, homes, shared) is None:
            log.info(
                "jupyter-vgpu demo: other accounts cannot run %s (%s); servers run with %s, the system's "
                "Python over this environment's packages",
                sys.executable,
                why_not,
                shared,
            )
            python, why_not = shared, None
        else:
            why_not = f"{why_not}; {why_shared or system_user.cannot_run_servers(probe, homes, shared)}"
    if why_not is None:
        c.DemoSpawner.accounts_per_user = True
        log.info("jupyter-vgpu demo: each user's server runs as a system account of that user's own")
    else:
        c.Spawner.args = ["--ServerApp.allow_root=True"]
        log.warning(
            "jupyter-vgpu demo: servers run as root, because other accounts cannot run this Python: %s. "
            "Anyone with the demo password can then act as root on this machine.",
            why_not,
        )
c.Spawner.cmd = [python, "-m", "jupyterhub.singleuser"]

simulate = os.environ.get("JUPYTER_VGPU_DEMO_SIMULATE")
if simulate is None:
    simulate = "0" if nvml.available() else "1"
    if simulate == "1":
        log.info("jupyter-vgpu demo: no NVIDIA driver answers; simulating two 80 GiB GPUs")
c.GPUInventory.simulate = simulate == "1"
if os.environ.get("JUPYTER_VGPU_DEMO_GPU_MEMORY"):
    c.GPUInventory.simulated_memory = os.environ["JUPYTER_VGPU_DEMO_GPU_MEMORY"]
mig = os.environ.get("JUPYTER_VGPU_DEMO_MIG")
if mig:
    c.GPUInventory.simulated_mig_profiles = {"1": [p.strip() for p in mig.split(",") if p.strip()]}
c.VGPUHub.isolation = os.environ.get("JUPYTER_VGPU_DEMO_ISOLATION", "time-slicing")
node_token = os.environ.get("JUPYTER_VGPU_DEMO_NODE_TOKEN")
if node_token:  # a Kubernetes node arbiter's token, as Zero to JupyterHub's values give one
    c.JupyterHub.services = [*c.JupyterHub.services, {"name": "vgpu-node", "api_token": node_token}]
    c.JupyterHub.load_roles = [
        *c.JupyterHub.load_roles,
        {"name": "vgpu-node", "scopes": ["read:users", "custom:vgpu-nodes:write"], "services": ["vgpu-node"]},
    ]
c.VGPUHub.default_memory_limit = "8G"
c.VGPUHub.default_compute_share = 50
c.VGPUHub.overcommit_ratio = 1.5
