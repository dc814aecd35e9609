"""Wiring of the server extension: slice from the environment, channel, sampling, Hub sync."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
from pathlib import Path

from jupyter_core.paths import jupyter_runtime_dir
from tornado.ioloop import PeriodicCallback

from jupyter_vgpu import channel
from jupyter_vgpu.slice import Slice, SliceError

from .config import VGPUServer
from .handlers import handlers
from .hub_report import HubReport
from .hub_sync import HubSync
from .kernel_sockets import keep_short
from .sampler import Sampler
from .state import ServerState


def _share_log(serverapp) -> None:
    """Send the package's log records (``jupyter_vgpu`` logger) to the server's log."""
    vlog = logging.getLogger("jupyter_vgpu")
    if not vlog.handlers:
        for handler in serverapp.log.handlers:
            vlog.addHandler(handler)
        vlog.setLevel(serverapp.log.level)
        vlog.propagate = False


def _preload_kernels(slice_: Slice | None, config: VGPUServer, environ) -> str | None:
    """The ``LD_PRELOAD`` value kernels must start with so they can be paused, or None
    (no slice, a simulated GPU, turned off, or the allocator cannot be built here: said
    in the log, and kernels then run without pausing)."""
    if slice_ is None or slice_.simulated or not config.pausable_allocator:
        return None
    from jupyter_vgpu.kernel.pause import vmm

    try:
        return vmm.preload_environment(dict(environ))["LD_PRELOAD"]
    except vmm.VMMUnavailable as e:
        logging.getLogger("jupyter_vgpu").warning(
            "jupyter-vgpu: kernels start without the pausable allocator, so they cannot be paused: %s", e
        )
        return None


def load(serverapp) -> None:
    config = VGPUServer(parent=serverapp)
    log = serverapp.log
    _share_log(serverapp)
    try:
        slice_ = Slice.from_env()
    except SliceError as e:
        log.error("jupyter-vgpu: ignoring a malformed slice in the environment: %s", e)
        slice_ = None
    directory = Path(config.channel_dir or Path(jupyter_runtime_dir()) / f"jupyter-vgpu-{os.getpid()}")
    directory.mkdir(parents=True, exist_ok=True)
    os.environ[channel.CHANNEL_ENV] = str(directory)  # inherited by every kernel this server starts
    if not config.channel_dir:
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    keep_short(serverapp.kernel_manager)  # kernels over ipc: sockets at paths a socket can have
    preload = _preload_kernels(slice_, config, os.environ)
    if preload:
        os.environ["LD_PRELOAD"] = preload  # read when a kernel or terminal starts, not by this process
    state = ServerState(directory, slice_)
    sampler = Sampler(serverapp, state, config)
    serverapp.web_app.add_handlers(".*$", handlers(serverapp.web_app.settings["base_url"], sampler))
    PeriodicCallback(sampler.current, config.sample_seconds * 1000).start()
    sync = HubSync.from_env(state) if config.hub_sync else None
    if sync is not None:
        PeriodicCallback(sync.poll, config.hub_poll_seconds * 1000).start()
    report = HubReport.from_env(sampler.current, config.hub_report_url) if config.hub_report else None
    if report is not None:
        PeriodicCallback(report.report, config.hub_report_seconds * 1000).start()
    serverapp.web_app.settings["jupyter_vgpu"] = {
        "state": state,
        "sampler": sampler,
        "hub_sync": sync,
        "hub_report": report,
    }
    where = "no slice" if slice_ is None else f"slice on GPU {slice_.gpu_index} ({slice_.gpu_name})"
    log.info("jupyter-vgpu: %s; channel %s%s", where, directory, "; following the Hub" if sync else "")
