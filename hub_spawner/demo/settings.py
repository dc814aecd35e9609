"""The demo Hubs' settings, shared by ``jupyterhub_config.py`` (the demo on this host)
and ``slurm_config.py`` (the demo on a Slurm test cluster).

Each demo mode keeps a state directory of its own (``.vgpu-demo`` and
``.vgpu-demo-slurm`` in the checkout, or ``JUPYTER_VGPU_DEMO_DIR``): the Hub's database,
cookie secret and PID files, users' homes, the arbiter's socket and disk tier,
``demo.json``, which says which mode the directory belongs to and where its servers'
cgroups go, and ``accounts``, the system accounts it made (``scripts/demo stop`` and
``clean`` read them, :mod:`hub_spawner.demo.control`). A Hub of one mode refuses the other's directory:
its database names servers the other mode started, which it could neither adopt nor
end.

Everything the log says here is what this Hub does: how many simulated GPUs of what
size, and which account users' servers run as (or why root).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
from pathlib import Path

from jupyter_vgpu import nvml

from . import system_user

#: The state directory of each mode, relative to where the Hub starts (the checkout).
DEFAULT_DIRS = {"local": ".vgpu-demo", "slurm": ".vgpu-demo-slurm"}
#: What a state directory says about itself.
META = "demo.json"
#: The Hub's PID file in the state directory (``scripts/demo stop`` signals it).
HUB_PID = "jupyterhub.pid"
#: System accounts the demo made, one a line (``scripts/demo clean`` removes them).
ACCOUNTS = "accounts"

log = logging.getLogger("JupyterHub")


def state_dir(mode: str) -> Path:
    """This mode's state directory: ``JUPYTER_VGPU_DEMO_DIR``, else its default."""
    return Path(os.environ.get("JUPYTER_VGPU_DEMO_DIR") or DEFAULT_DIRS[mode]).resolve()


def cgroup_names(state: Path) -> tuple[str, str]:
    """``(cgroup parent, systemd slice)`` of the demo in ``state``: its own, so that
    stopping it ends its servers only, whatever other demos or Hubs run here."""
    name = re.sub(r"[^A-Za-z0-9-]", "-", state.name).strip("-")[:24] or "demo"
    tag = hashlib.sha256(str(state).encode()).hexdigest()[:8]
    return f"/jupyter-vgpu-demo/{name}-{tag}", f"jupyter_vgpu_demo_{tag}.slice"


def read_meta(state: Path) -> dict:
    """``demo.json`` of ``state`` ({} when it has none or it cannot be read)."""
    try:
        meta = json.loads((state / META).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def claim(state: Path, mode: str) -> dict:
    """Make ``state`` this mode's state directory (created if missing), or exit saying
    why not: it belongs to the other mode.

    Returns:
        what ``demo.json`` now says.
    """
    state.mkdir(parents=True, exist_ok=True)
    meta = read_meta(state)
    if meta.get("mode", mode) != mode:
        sys.exit(
            f"jupyter-vgpu demo: {state} is the state directory of the {meta['mode']} demo, whose "
            f"servers this {mode} demo could neither adopt nor end. Stop and clean that one first "
            "(bash scripts/demo stop; bash scripts/demo clean), or give this one another "
            "JUPYTER_VGPU_DEMO_DIR."
        )
    parent, slice_unit = cgroup_names(state)
    meta.update(
        {
            "mode": mode,
            "cgroup_parent": os.environ.get("JUPYTER_VGPU_DEMO_CGROUP_PARENT") or parent,
            "systemd_slice": slice_unit,
        }
    )
    (state / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def common(c, mode: str) -> tuple[Path, dict]:
    """What both demos set: state, ports on 127.0.0.1, the database, logins, timeouts,
    quotas, and each server's cgroup under the demo's own parent.

    Returns:
        ``(state directory, demo.json)``.
    """
    os.umask(0o077)  # the Hub's database, cookie secret and logs are readable by the Hub only
    state = state_dir(mode)
    meta = claim(state, mode)
    homes = state / "users"
    homes.mkdir(parents=True, exist_ok=True)
    for directory in (state, homes):
        directory.chmod(0o711)  # servers may pass through to their homes, not list or read
    for private in ("jupyterhub.sqlite", "jupyterhub_cookie_secret", META):
        if (state / private).exists():
            (state / private).chmod(0o600)
    port = int(os.environ.get("JUPYTER_VGPU_DEMO_PORT", "8000"))
    c.JupyterHub.bind_url = f"http://127.0.0.1:{port}"
    c.JupyterHub.hub_ip = "127.0.0.1"
    c.JupyterHub.hub_port = int(os.environ.get("JUPYTER_VGPU_DEMO_HUB_PORT", port + 81))
    c.ConfigurableHTTPProxy.api_url = (
        f"http://127.0.0.1:{int(os.environ.get('JUPYTER_VGPU_DEMO_PROXY_PORT', port + 1))}"
    )
    c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
    c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
    c.JupyterHub.pid_file = str(state / HUB_PID)
    c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")
    # The demo's Hub stops its users' servers when it stops (Ctrl-C, scripts/demo stop).
    # JUPYTER_VGPU_DEMO_KEEP_SERVERS=1 keeps them running across a restart instead, as a
    # real host's Hub does (docs/admin.md): the Hub started again adopts them.
    c.JupyterHub.cleanup_servers = os.environ.get("JUPYTER_VGPU_DEMO_KEEP_SERVERS") != "1"

    c.JupyterHub.authenticator_class = "hub_spawner.demo.authenticator.DemoAuthenticator"
    c.DemoAuthenticator.password = os.environ.get("JUPYTER_VGPU_DEMO_PASSWORD", "vgpu-demo")
    c.Authenticator.allow_all = True
    c.Authenticator.admin_users = {"admin"}

    c.Spawner.default_url = "/lab"
    # Show the spawn page (with where the vGPU slice went) at once instead of a blank wait.
    c.JupyterHub.tornado_settings = {"slow_spawn_timeout": 0}
    c.Spawner.http_timeout = 60
    c.Spawner.start_timeout = 120
    c.DemoSpawner.cgroup_parent = meta["cgroup_parent"]
    c.DemoSpawner.cgroup_systemd_slice = meta["systemd_slice"]
    c.DemoSpawner.accounts_file = str(state / ACCOUNTS)
    c.DemoSlurmSpawner.accounts_file = str(state / ACCOUNTS)
    c.VGPUHub.default_memory_limit = "8G"
    c.VGPUHub.default_compute_share = 50
    c.VGPUHub.overcommit_ratio = 1.5
    return state, meta


def server_python(state: Path) -> tuple[str, str | None]:
    """The Python users' servers run with, and why they must run as root (None when each
    user's server can run as a system account of that user's own).

    Accounts are tried with :data:`system_user.PROBE_ACCOUNT`. Where it cannot run this
    Python (a virtual environment made from a Python under ``/root``), the system's
    Python of the same version over this environment's packages
    (:func:`system_user.shared_python`, in ``<state>/python``) is tried.
    """
    python = sys.executable
    if os.geteuid() != 0:
        return python, "the Hub does not run as root"
    homes = state / "users"
    probe = system_user.ensure(system_user.PROBE_ACCOUNT, record=state / ACCOUNTS)
    if probe is None:
        return python, f"no account {system_user.PROBE_ACCOUNT} can be made"
    why_not = system_user.cannot_run_servers(probe, homes)
    if why_not is None:
        return python, None
    shared, why_shared = system_user.shared_python(state / "python")
    if shared is not None:
        still = system_user.cannot_run_servers(probe, homes, shared)
        if still is None:
            log.info(
                "jupyter-vgpu demo: other accounts cannot run %s (%s); servers run with %s, the system's "
                "Python over this environment's packages",
                sys.executable,
                why_not,
                shared,
            )
            return shared, None
        why_shared = still
    return python, f"other accounts cannot run this Python: {why_not}; {why_shared}"


def simulated_gpus(c) -> str | None:
    """Simulate GPUs where asked (``JUPYTER_VGPU_DEMO_SIMULATE``) or where no NVIDIA driver
    answers; returns how many of what size, in words, or None on real GPUs."""
    simulate = os.environ.get("JUPYTER_VGPU_DEMO_SIMULATE")
    if simulate is None:
        simulate = "0" if nvml.available() else "1"
    c.GPUInventory.simulate = simulate == "1"
    if simulate != "1":
        return None
    from ..sizes import format_size, parse_size

    memory = os.environ.get("JUPYTER_VGPU_DEMO_GPU_MEMORY")
    size = parse_size(memory, field="JUPYTER_VGPU_DEMO_GPU_MEMORY") if memory else 80 * 2**30
    if memory:
        c.GPUInventory.simulated_memory = size
        c.GPUInventory.simulated_name = f"Simulated GPU, {format_size(size)}"
    return f"two simulated GPUs of {format_size(size)}"


def local(c) -> Path:
    """The demo on this host: every user's server a process here, in a cgroup of its own,
    as a system account of its user's own when the Hub is root; the node arbiter a
    service of the Hub; simulated GPUs when NVML finds none."""
    import hub_spawner

    state, _meta = common(c, "local")
    # The node arbiter (a managed service) listens in the state directory, so that demo
    # Hubs side by side (the tests) each have their own; a socket path has at most 107 bytes.
    arbiter_socket = state / "arbiter" / "arbiter.sock"
    # JUPYTER_VGPU_DEMO_ARBITER_TOKEN: the arbiter runs outside the Hub with that token, as
    # a real host's systemd unit runs it (docs/admin.md); whoever starts it gives it its
    # socket and disk tier
    hub_spawner.setup(
        c,
        arbiter_socket=str(arbiter_socket) if len(str(arbiter_socket)) < 100 else None,
        arbiter_token=os.environ.get("JUPYTER_VGPU_DEMO_ARBITER_TOKEN") or None,
    )
    # ... and keeps its disk tier (paused kernels moved out of host memory) there too
    for service in c.JupyterHub.services:
        if service["name"] == hub_spawner.ARBITER_SERVICE and "command" in service:
            service["command"].append(f"--ArbiterApp.disk_dir={state / 'disk'}")
    # Demo users are not system users: the demo makes each one a system account of their
    # own (hub_spawner.demo.system_user) when the Hub is root, and runs their server as it,
    # with JupyterLab, in a cgroup of its own.
    c.JupyterHub.spawner_class = "hub_spawner.demo.spawner.DemoSpawner"
    server_ports = os.environ.get("JUPYTER_VGPU_DEMO_SERVER_PORTS")
    if server_ports:  # "LOW-HIGH": demo Hubs side by side (the tests) each take their own
        found = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", server_ports)
        if not found:
            raise ValueError(
                f"JUPYTER_VGPU_DEMO_SERVER_PORTS={server_ports!r}: expected LOW-HIGH, e.g. 20000-29999"
            )
        c.DemoSpawner.port_range = (int(found.group(1)), int(found.group(2)))
    c.SimpleLocalProcessSpawner.home_dir_template = str(state / "users" / "{username}")
    python, why_root = server_python(state)
    if why_root is None:
        c.DemoSpawner.accounts_per_user = True
        accounts = "each user's server runs as a system account of that user's own (vgpu-<name>)"
    elif os.geteuid() == 0:
        c.Spawner.args = ["--ServerApp.allow_root=True"]
        accounts = (
            f"servers run as root, because {why_root}. Anyone with the demo password can then act "
            "as root on this machine"
        )
    else:
        accounts = (
            "every user's server runs as this Hub's own account, so users can reach each other's kernels"
        )
    c.Spawner.cmd = [python, "-m", "jupyterhub.singleuser"]
    gpus = simulated_gpus(c)
    mig = os.environ.get("JUPYTER_VGPU_DEMO_MIG")
    if mig:
        c.GPUInventory.simulated_mig_profiles = {"1": [p.strip() for p in mig.split(",") if p.strip()]}
    c.VGPUHub.isolation = os.environ.get("JUPYTER_VGPU_DEMO_ISOLATION", "time-slicing")
    node_token = os.environ.get("JUPYTER_VGPU_DEMO_NODE_TOKEN")
    if node_token:  # a Kubernetes node arbiter's token, as Zero to JupyterHub's values give one
        c.JupyterHub.services = [*c.JupyterHub.services, {"name": "vgpu-node", "api_token": node_token}]
        c.JupyterHub.load_roles = [
            *c.JupyterHub.load_roles,
            {
                "name": "vgpu-node",
                "scopes": ["read:users", "custom:vgpu-nodes:write"],
                "services": ["vgpu-node"],
            },
        ]
    where = (
        f"{gpus} on this host (no NVIDIA driver answers, or JUPYTER_VGPU_DEMO_SIMULATE=1)"
        if gpus
        else "the GPUs NVML lists on this host"
    )
    (log.info if why_root is None else log.warning)(
        "jupyter-vgpu demo (state %s): slices on %s; %s", state, where, accounts
    )
    return state


def slurm(c) -> Path:
    """The demo on a Slurm test cluster (``scripts/slurm-cluster``, described by the file
    ``JUPYTER_VGPU_DEMO_SLURM`` names): every user's server a Slurm batch job on a node,
    submitted as that user's own system account as a real site's Hub submits it (where
    other accounts can run this Python, else as root, saying why), its slice on the
    nodes' simulated GPUs, a node arbiter per node instead of one beside the Hub."""
    import hub_spawner

    from ..sizes import format_size

    state, _meta = common(c, "slurm")
    cluster = json.loads(Path(os.environ["JUPYTER_VGPU_DEMO_SLURM"]).read_text())
    hub_spawner.setup_slurm(c, node_token=os.environ.get("JUPYTER_VGPU_DEMO_NODE_TOKEN"))
    c.VGPUHub.arbiter_socket = ""
    c.JupyterHub.spawner_class = "hub_spawner.demo.slurm.DemoSlurmSpawner"
    # The nodes' servers reach the Hub's API on the cluster's bridge.
    c.JupyterHub.hub_ip = cluster["host_address"]
    c.DemoSlurmSpawner.home_template = str(state / "users" / "{username}")
    c.SlurmSpawner.req_partition = cluster["partition"]
    python, why_root = server_python(state)
    bindir = Path(sys.executable).parent
    # batchspawner-singleuser, run by a Python the job's account can run, posts the port
    # and runs jupyterhub-singleuser (a script of this environment, read as Python source)
    c.SlurmSpawner.batchspawner_singleuser_cmd = f"{python} -m batchspawner.singleuser"
    c.Spawner.cmd = [str(bindir / "jupyterhub-singleuser")]
    # sbatch and the job need the cluster's configuration (SLURM_CONF) and this PATH
    c.Spawner.env_keep = ["JUPYTERHUB_SINGLEUSER_APP", "PATH", "LANG", "SLURM_CONF"]
    if why_root is None:
        c.DemoSlurmSpawner.accounts_per_user = True
        accounts = "submitted as each user's own system account (vgpu-<name>), as a real site submits them"
    else:
        c.DemoSlurmSpawner.accounts_per_user = False
        if os.geteuid() == 0:
            c.Spawner.args = ["--ServerApp.allow_root=True"]
        accounts = f"submitted as this Hub's own account (uid {os.geteuid()}), because {why_root}"
    c.SlurmSpawner.startup_poll_interval = 0.25
    c.SlurmSpawner.start_timeout = 120
    c.VGPUSlurmSpawner.vgpu_arbiter_socket = f"{cluster['dir']}/arbiter/{{node}}/arbiter.sock"
    c.VGPUSlurmSpawner.vgpu_pending_timeout = float(os.environ.get("JUPYTER_VGPU_DEMO_SLURM_PENDING", "60"))
    # 1 GiB per shard: the nodes' simulated GPUs have shards_per_gpu shards each
    c.GPUInventory.simulate = True
    memory = cluster["shards_per_gpu"] * 2**30
    c.GPUInventory.simulated_memory = memory
    c.GPUInventory.simulated_name = f"Simulated GPU, {cluster['shards_per_gpu']} GiB (Slurm GRES)"
    c.VGPUHub.placement = os.environ.get("JUPYTER_VGPU_DEMO_PLACEMENT", "binpack")
    profiles = os.environ.get("JUPYTER_VGPU_DEMO_SLURM_PROFILES")
    if profiles:  # the spawn form's choices, as JSON (VGPUSlurmSpawner.profile_list)
        c.VGPUSlurmSpawner.profile_list = json.loads(profiles)
    nodes = ", ".join(cluster["nodes"])
    (log.info if why_root is None else log.warning)(
        "jupyter-vgpu demo on the Slurm test cluster %s (state %s): nodes %s, each with %d simulated GPUs "
        "of %s (GRES on dummy device files; no NVIDIA driver on the nodes, so their arbiters find no "
        "NVML); every user's server is a Slurm job %s",
        cluster["dir"],
        state,
        nodes,
        cluster["gpus_per_node"],
        format_size(memory),
        accounts,
    )
    return state
