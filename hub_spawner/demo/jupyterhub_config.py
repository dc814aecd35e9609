# The demo Hub of jupyter-vgpu: real JupyterHub, real configurable-http-proxy,
# JupyterLab, SQLite, and simulated GPUs when NVML finds none.
#
#   jupyterhub -f hub_spawner/demo/jupyterhub_config.py
#
# Environment (all optional):
#   JUPYTER_VGPU_DEMO_PASSWORD  shared password of every demo user (default: vgpu-demo)
#   JUPYTER_VGPU_DEMO_DIR       state directory: database, cookie secret, logs (default: ./.vgpu-demo)
#   JUPYTER_VGPU_DEMO_PORT      public port on 127.0.0.1 (default: 8000)
#   JUPYTER_VGPU_DEMO_SIMULATE  "1": always simulate GPUs; "0": real GPUs only
import os
import sys
from pathlib import Path

import hub_spawner

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file

state = Path(os.environ.get("JUPYTER_VGPU_DEMO_DIR", ".vgpu-demo")).resolve()
state.mkdir(parents=True, exist_ok=True)
port = int(os.environ.get("JUPYTER_VGPU_DEMO_PORT", "8000"))

hub_spawner.setup(c)

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

# Demo users are not system users: run every server as the user running the Hub, in
# this very Python, with JupyterLab.
c.JupyterHub.spawner_class = "hub_spawner.spawner.VGPUSimpleSpawner"
c.SimpleLocalProcessSpawner.home_dir_template = str(state / "users" / "{username}")
c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
c.Spawner.default_url = "/lab"
if os.geteuid() == 0:  # containers and CI machines often run everything as root
    c.Spawner.args = ["--ServerApp.allow_root=True"]
c.Spawner.http_timeout = 60
c.Spawner.start_timeout = 120

simulate = os.environ.get("JUPYTER_VGPU_DEMO_SIMULATE")
if simulate is not None:
    c.GPUInventory.simulate = simulate == "1"
c.VGPUHub.default_memory_limit = "8G"
c.VGPUHub.default_compute_share = 50
c.VGPUHub.overcommit_ratio = 1.5
