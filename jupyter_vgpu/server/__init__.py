"""The single-user server extension: serves ``/api/vgpu/...`` and feeds kernels their slice."""


def _load_jupyter_server_extension(serverapp):
    from .extension import load

    load(serverapp)
