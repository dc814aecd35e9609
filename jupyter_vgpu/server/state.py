"""The server's view of its slice, written to the channel for its kernels."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from jupyter_vgpu import channel
from jupyter_vgpu.slice import Slice

log = logging.getLogger("jupyter_vgpu")


class ServerState:
    """The slice and pressure flag this server hands its kernels through ``server.json``.

    Args:
        directory: the channel directory.
        slice_: the slice from the spawner, or None.
    """

    def __init__(self, directory: Path, slice_: Slice | None):
        self.directory = directory
        self.slice = slice_
        self.pressure = False
        #: kernel id -> unix seconds of the last prefetch asked for it (see :meth:`prefetch`)
        self.prefetches: dict[str, float] = {}
        #: bumped on every publish, so that samples taken before a change are retaken.
        self.revision = 0
        self.publish()

    def publish(self) -> None:
        """Write ``server.json`` (atomically) after a change of the slice or the pressure
        flag: samples taken before it are retaken."""
        self.revision += 1
        self._write()

    def _write(self) -> None:
        channel.write_json(
            channel.server_path(self.directory),
            {
                "slice": self.slice.to_dict() if self.slice else None,
                "pressure": self.pressure,
                "prefetch": self.prefetches,
                "updated": time.time(),
            },
        )

    def prefetch(self, kernel_id: str, now: float | None = None) -> None:
        """Ask kernel ``kernel_id`` to come back ahead of a cell (its user is working in its
        notebook); the kernel reads it within half a second. Requests older than a minute
        are dropped from the document."""
        now = time.time() if now is None else now
        self.prefetches = {k: t for k, t in self.prefetches.items() if now - t < 60}
        self.prefetches[kernel_id] = now
        self._write()  # the usage document does not change: no sample is retaken

    def update(self, *, slice_: Slice | None = None, pressure: bool | None = None) -> bool:
        """Change the slice and/or the pressure flag; publish when something changed."""
        changed = False
        if slice_ is not None and slice_ != self.slice:
            log.info(
                "jupyter-vgpu: new slice from the Hub: %d bytes, %d%% compute",
                slice_.memory_limit,
                slice_.compute_share,
            )
            self.slice, changed = slice_, True
        if pressure is not None and pressure != self.pressure:
            log.info("jupyter-vgpu: card pressure %s", "on" if pressure else "off")
            self.pressure, changed = pressure, True
        if changed:
            self.publish()
        return changed
