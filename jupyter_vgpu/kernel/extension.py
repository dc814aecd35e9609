"""IPython entry points of the kernel hook (``%load_ext jupyter_vgpu``)."""

from __future__ import annotations

from .hook import KernelHook
from .magics import VGPUMagics, show_in_pager

_ATTR = "_jupyter_vgpu_hook"


def load_ipython_extension(ip) -> None:
    """Install the hook in shell ``ip``; loading twice keeps the first hook."""
    if getattr(ip, _ATTR, None) is not None:
        return
    hook = KernelHook(ip)
    setattr(ip, _ATTR, hook)
    ip.register_magics(VGPUMagics(ip, hook=hook))
    # `%vgpu?` prints its usage (frontends without a pager show no page payload)
    ip.set_hook("show_in_pager", show_in_pager, priority=10)
    hook.start()


def unload_ipython_extension(ip) -> None:
    """Remove the hook from shell ``ip`` (restoring anything offloaded)."""
    hook = getattr(ip, _ATTR, None)
    if hook is not None:
        hook.stop()
        setattr(ip, _ATTR, None)
        chain = getattr(getattr(ip.hooks, "show_in_pager", None), "chain", [])
        chain[:] = [(p, f) for p, f in chain if getattr(f, "__func__", f) is not show_in_pager]


def get_hook(ip) -> KernelHook | None:
    """The hook installed in ``ip``, or None."""
    return getattr(ip, _ATTR, None)
