# JupyterHub with jupyter-vgpu slices on a GPU host, run by deploy/systemd/jupyterhub.service
# beside the node arbiter's own unit, deploy/systemd/jupyter-vgpu-arbiter.service
# (docs/admin.md). Install it as /etc/jupyterhub/jupyterhub_config.py and adapt.
import os

import hub_spawner

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file

# The spawner `vgpu` (each user's server as their own Unix account, in a cgroup of its
# own), the /hub/api/vgpu API and /hub/vgpu page, and the node arbiter as a service of its
# own unit: the Hub knows it by its token and finds it at its socket.
hub_spawner.setup(
    c,
    arbiter_token=os.environ["JUPYTER_VGPU_ARBITER_TOKEN"],
    arbiter_socket="/run/jupyter-vgpu/arbiter.sock",
)

# The Hub's state in the unit's StateDirectory; back these two up (docs/admin.md).
c.JupyterHub.db_url = "sqlite:////var/lib/jupyterhub/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "/var/lib/jupyterhub/jupyterhub_cookie_secret"
c.ConfigurableHTTPProxy.pid_file = "/run/jupyterhub-proxy.pid"

# A Hub that stops (an upgrade, a restart) leaves users' servers and kernels running; the
# Hub started again adopts them, and ends, saying so, any it cannot.
c.JupyterHub.cleanup_servers = False

# Each server in a transient systemd scope of its own (jupyter_vgpu.slice), outside the
# Hub's unit: restarting the Hub does not touch it.
c.VGPUSpawner.cgroup_mode = "systemd"

# Users: the host's Unix accounts (PAM). Adapt: an OAuthenticator, LDAP, ...
c.Authenticator.admin_users = {"admin"}
c.Authenticator.allow_all = False
c.Authenticator.allowed_users = set()

# Slices (README, "What it does"; python -m hub_spawner.config lists every setting).
c.VGPUHub.default_memory_limit = "8G"
c.VGPUHub.overcommit_ratio = 1.5
c.VGPUHub.placement = "binpack"
