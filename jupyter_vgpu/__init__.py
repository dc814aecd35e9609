"""jupyter-vgpu, the user's side: the kernel hook and the single-user server extension.

Importing this package is cheap: it imports neither torch nor jupyter_server. The
kernel hook (``%load_ext jupyter_vgpu``, loaded in every kernel by the shipped IPython
config) lives in :mod:`jupyter_vgpu.kernel`; the server extension (enabled by
installing the package) in :mod:`jupyter_vgpu.server`.
"""

__version__ = "0.1.0"


def load_ipython_extension(ip):
    """IPython entry point: install the kernel hook in shell ``ip`` (idempotent)."""
    from .kernel.extension import load_ipython_extension as load

    load(ip)


def unload_ipython_extension(ip):
    """IPython entry point: remove the kernel hook from shell ``ip``."""
    from .kernel.extension import unload_ipython_extension as unload

    unload(ip)


def _jupyter_server_extension_points():
    return [{"module": "jupyter_vgpu.server"}]


def _jupyter_labextension_paths():
    return [{"src": "labextension", "dest": "jupyter-vgpu"}]
