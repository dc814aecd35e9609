"""jupyter-vgpu, the Hub's side: slice placement, quotas, the spawner and the REST API.

In ``jupyterhub_config.py``::

    import hub_spawner
    hub_spawner.setup(c)  # spawner "vgpu", the API, the /hub/vgpu page, metrics, the node arbiter
    c.VGPUHub.overcommit_ratio = 1.5
    c.VGPUHub.default_memory_limit = "8G"

``python -m hub_spawner.config`` prints every setting (JupyterHub's and ours). Never
imports torch.
"""

import logging

#: The one line logged instead of JupyterHub's deprecation warning for extra_handlers.
EXTRA_HANDLERS_NOTE = (
    "jupyter-vgpu serves /hub/api/vgpu and /hub/vgpu through JupyterHub.extra_handlers, deprecated "
    "since JupyterHub 3.1 but kept on purpose (docs/design.md: 'The Hub API lives in the Hub process')"
)


class _ExtraHandlersNote(logging.Filter):
    """Turns JupyterHub's warning about ``extra_handlers`` into one info line of ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and "extra_handlers is deprecated" in str(record.msg):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = EXTRA_HANDLERS_NOTE, ()
        return True


#: Name of the node arbiter's managed service (and of its role).
ARBITER_SERVICE = "vgpu-arbiter"


def setup(
    c, *, arbiter: bool = True, arbiter_socket: str | None = None, arbiter_token: str | None = None
) -> None:
    """Configure a Hub for vGPU slices: the ``vgpu`` spawner, the ``/hub/api/vgpu`` API,
    the ``/hub/vgpu`` page, the metrics, the node arbiter of this host, and the custom
    scope ``custom:vgpu-nodes:write`` (Kubernetes node arbiters' reports).

    Args:
        c: the config object of ``jupyterhub_config.py`` (``get_config()``).
        arbiter: run the node arbiter (``python -m jupyter_vgpu.node``) as the managed
            service ``vgpu-arbiter``: the Hub starts and restarts it, and its token may
            read users (the running slices, ``GET /hub/api/vgpu/slices``), nothing more.
            False: no arbiter (on Kubernetes it runs as a DaemonSet instead).
        arbiter_socket: its Unix socket; default: ``c.VGPUHub.arbiter_socket`` when set
            before this call, else ``/run/jupyter-vgpu/arbiter.sock`` for a root Hub and
            the Hub user's Jupyter runtime directory otherwise. Servers and kernels get
            it in ``JUPYTER_VGPU_ARBITER``.
        arbiter_token: the node arbiter runs outside the Hub, as a systemd unit of its
            own (``deploy/systemd/jupyter-vgpu-arbiter.service``; docs/admin.md), with
            this token (its ``JUPYTERHUB_API_TOKEN``): registered as the service
            ``vgpu-arbiter``, whose role reads users, and not started by the Hub. It
            then keeps running while the Hub restarts, and either can be upgraded alone.

    To keep another spawner, set ``c.JupyterHub.spawner_class`` afterwards to a class
    that puts :class:`hub_spawner.spawner.VGPUSpawnerMixin` first in its bases.
    """
    from pathlib import Path

    import jupyter_vgpu

    from . import metrics
    from .api import NODES_SCOPE, handlers
    from .page import VGPUPageHandler

    # which code runs (an upgrade restarts the Hub on the new one: docs/admin.md)
    logging.getLogger("JupyterHub").info(
        "jupyter-vgpu %s, code in %s", jupyter_vgpu.__version__, Path(__file__).resolve().parent
    )
    c.JupyterHub.spawner_class = "vgpu"
    ours = [*handlers, (r"/vgpu", VGPUPageHandler)]
    existing = list(c.JupyterHub.extra_handlers) if "extra_handlers" in c.JupyterHub else []
    c.JupyterHub.extra_handlers = existing + [h for h in ours if h not in existing]
    hub_log = logging.getLogger("JupyterHub")  # the JupyterHub application's logger
    if not any(isinstance(f, _ExtraHandlersNote) for f in hub_log.filters):
        hub_log.addFilter(_ExtraHandlersNote())
    from .adoption import StoppedNote

    if not any(isinstance(f, StoppedNote) for f in hub_log.filters):
        hub_log.addFilter(StoppedNote())  # servers it ended because it could not adopt them
    templates = str(Path(__file__).parent / "templates")
    paths = list(c.JupyterHub.template_paths) if "template_paths" in c.JupyterHub else []
    c.JupyterHub.template_paths = [templates, *[p for p in paths if p != templates]]
    metrics.register(_snapshot)
    scopes = dict(c.JupyterHub.custom_scopes) if "custom_scopes" in c.JupyterHub else {}
    scopes.setdefault(NODES_SCOPE, {"description": "Report a GPU node's devices and pods to jupyter-vgpu"})
    c.JupyterHub.custom_scopes = scopes
    if arbiter_token:
        _run_arbiter(c, arbiter_socket, arbiter_token)
    elif arbiter:
        _run_arbiter(c, arbiter_socket)


def _run_arbiter(c, socket: str | None, token: str | None = None) -> None:
    """The node arbiter as a managed service with a role that reads users, on ``socket``;
    with ``token``, an external service of that token instead (its own systemd unit)."""
    import sys

    from jupyter_vgpu.host.socket_path import default_socket

    if not socket:
        socket = c.VGPUHub.arbiter_socket if "arbiter_socket" in c.VGPUHub else ""
    socket = socket or default_socket()
    c.VGPUHub.arbiter_socket = socket
    if token:
        service = {"name": ARBITER_SERVICE, "display": False, "api_token": token}
    else:
        service = {
            "name": ARBITER_SERVICE,
            "display": False,
            "command": [sys.executable, "-m", "jupyter_vgpu.node", f"--socket={socket}"],
        }
    services = list(c.JupyterHub.services) if "services" in c.JupyterHub else []
    c.JupyterHub.services = [s for s in services if s.get("name") != ARBITER_SERVICE] + [service]
    role = {
        "name": ARBITER_SERVICE,
        "description": "The node arbiter: reads the running vGPU slices to know whose kernels it serves.",
        "scopes": ["read:users"],
        "services": [ARBITER_SERVICE],
    }
    roles = list(c.JupyterHub.load_roles) if "load_roles" in c.JupyterHub else []
    c.JupyterHub.load_roles = [r for r in roles if r.get("name") != ARBITER_SERVICE] + [role]


def setup_kubernetes(c) -> None:
    """:func:`setup`, for a Hub on Kubernetes: the ``vgpu-kube`` spawner (KubeSpawner with
    slices) and GPUs from the node arbiters' reports instead of NVML on the Hub's host.
    The arbiters run as a DaemonSet (``deploy/kubernetes/``), not as a service of the
    Hub; their token needs ``read:users`` and ``custom:vgpu-nodes:write`` (which
    :func:`setup` registers).

    Args:
        c: the config object (Zero to JupyterHub: ``hub.extraConfig``).
    """
    setup(c, arbiter=False)
    c.JupyterHub.spawner_class = "vgpu-kube"
    c.GPUInventory.source = "nodes"


def setup_slurm(c, *, node_token: str | None = None) -> None:
    """:func:`setup`, for a Hub whose users' servers run as Slurm jobs: the ``vgpu-slurm``
    spawner (batchspawner's SlurmSpawner with slices, :mod:`hub_spawner.slurm`), GPUs from
    the Slurm nodes and their arbiters' reports instead of NVML on the Hub's host, and
    an API where a job's server says its port (``/hub/api/batchspawner``, in place of
    batchspawner's own handler: :mod:`hub_spawner.slurm_api`). The arbiters run on the
    nodes (a systemd unit each), not as a service of the Hub.

    Args:
        c: the config object of ``jupyterhub_config.py``.
        node_token: the token the node arbiters use (``JUPYTERHUB_API_TOKEN`` of their
            unit): registered as the service ``vgpu-nodes`` with ``read:users`` and
            ``custom:vgpu-nodes:write``. None: configure their service yourself.
    """
    from .slurm_api import replace_batchspawners_handler

    setup(c, arbiter=False)
    ours = replace_batchspawners_handler()
    existing = list(c.JupyterHub.extra_handlers)
    c.JupyterHub.extra_handlers = existing + [h for h in ours if h not in existing]
    c.JupyterHub.spawner_class = "vgpu-slurm"
    c.GPUInventory.source = "nodes"
    if node_token:
        services = list(c.JupyterHub.services) if "services" in c.JupyterHub else []
        c.JupyterHub.services = [s for s in services if s.get("name") != NODES_SERVICE] + [
            {"name": NODES_SERVICE, "api_token": node_token}
        ]
        role = {
            "name": NODES_SERVICE,
            "description": "Node arbiters: read the running vGPU slices and report their nodes.",
            "scopes": ["read:users", "custom:vgpu-nodes:write"],
            "services": [NODES_SERVICE],
        }
        roles = list(c.JupyterHub.load_roles) if "load_roles" in c.JupyterHub else []
        c.JupyterHub.load_roles = [r for r in roles if r.get("name") != NODES_SERVICE] + [role]


#: Name of the node arbiters' service (and role) on Slurm (:func:`setup_slurm`).
NODES_SERVICE = "vgpu-nodes"


def _snapshot():
    """The running Hub's slices and GPUs for the metrics collector (None before it runs)."""
    from jupyterhub.app import JupyterHub

    from .config import VGPUHub

    if not JupyterHub.initialized():
        return None
    app = JupyterHub.instance()
    if not app.trait_has_value("users"):  # still starting: reading it would build it too early
        return None
    return VGPUHub.instance(config=app.config).snapshot(app.users)
