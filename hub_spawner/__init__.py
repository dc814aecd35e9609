"""jupyter-vgpu, the Hub's side: slice placement, quotas, the spawner and the REST API.

In ``jupyterhub_config.py``::

    import hub_spawner
    hub_spawner.setup(c)            # spawner_class = "vgpu" and the /hub/api/vgpu handlers
    c.VGPUHub.overcommit_ratio = 1.5
    c.VGPUHub.default_memory_limit = "8G"

Never imports torch.
"""


def setup(c) -> None:
    """Configure a Hub for vGPU slices: the ``vgpu`` spawner and the ``/hub/api/vgpu`` API.

    Args:
        c: the config object of ``jupyterhub_config.py`` (``get_config()``).

    To keep another spawner, set ``c.JupyterHub.spawner_class`` afterwards to a class
    that puts :class:`hub_spawner.spawner.VGPUSpawnerMixin` first in its bases.
    """
    from .api import handlers

    c.JupyterHub.spawner_class = "vgpu"
    existing = list(c.JupyterHub.extra_handlers) if "extra_handlers" in c.JupyterHub else []
    c.JupyterHub.extra_handlers = existing + [h for h in handlers if h not in existing]
