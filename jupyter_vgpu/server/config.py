"""Every setting of the server extension, in one Configurable (``c.VGPUServer.<trait>``)."""

from __future__ import annotations

from traitlets import Bool, Float, Unicode
from traitlets.config import Configurable

from .hub_report import DEFAULT_URL


class VGPUServer(Configurable):
    """jupyter-vgpu in the single-user server."""

    sample_seconds = Float(1.0, help="Seconds between two usage samples (kernel reports and NVML).").tag(
        config=True
    )

    hub_poll_seconds = Float(
        2.0,
        help="Seconds between two polls of the Hub for this server's slice; a quota change "
        "reaches kernels within this plus the kernels' own half-second poll.",
    ).tag(config=True)

    hub_sync = Bool(True, help="Follow quota changes from the Hub (only when running under JupyterHub).").tag(
        config=True
    )

    hub_report = Bool(
        True, help="Send this server's usage to the Hub (only when running under JupyterHub)."
    ).tag(config=True)

    hub_report_seconds = Float(10.0, help="Seconds between two usage reports to the Hub.").tag(config=True)

    hub_report_url = Unicode(
        DEFAULT_URL,
        help="Where usage reports are POSTed; {api_url} is JUPYTERHUB_API_URL and {user} the "
        'URL-quoted user name. Body: {"server_name": str, "usage": <the /api/vgpu/usage document>}.',
    ).tag(config=True)

    pressure_fraction = Float(
        0.95,
        help="The card is shown under pressure (usage document, panel) when NVML reports more "
        "than this fraction of its memory in use. Real GPUs only; making room is the node "
        "arbiter's job.",
    ).tag(config=True)

    channel_dir = Unicode(
        "",
        help="Directory of the server<->kernel channel; default: a directory of this server's "
        "own under the Jupyter runtime directory.",
    ).tag(config=True)

    pausable_allocator = Bool(
        True,
        help="Start kernels (and terminals) with the pausable allocator in LD_PRELOAD when "
        "the slice is on a real GPU, so that the node arbiter can pause them. Built from C "
        "on first use (a C compiler is needed once), or packaged beside the module.",
    ).tag(config=True)

    stale_seconds = Float(
        10.0, help="A kernel report older than this is shown as stale (the kernel may be hung)."
    ).tag(config=True)
