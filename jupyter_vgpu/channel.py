"""The file channel between a single-user server and its kernels.

The server and each of its kernels exchange small JSON documents through one
directory (the *channel directory*), named to kernels by the ``JUPYTER_VGPU_CHANNEL``
environment variable that the server extension sets before any kernel starts:

- ``server.json``, written by the server: ``{"slice": <Slice dict> | null,
  "pressure": bool, "updated": <unix seconds>}``. Kernels poll it (a ``stat`` every
  half second from a daemon thread), so a quota change or a pressure signal reaches a
  kernel even while a cell is running.
- ``kernel-<kernel id>.json``, written by each kernel about once a second: its PID and
  usage (see ``jupyter_vgpu.kernel`` for the fields). The server's sampler reads them.

Why files and not a Jupyter channel: the shell channel is served in order behind the
running cell, so a budget change would wait for a long cell to end, and the control
channel accepts only ipykernel's own message types. A file in the server's runtime
directory, written atomically (a temporary file, then a rename), is read while cells run, needs
no socket or port, and costs one ``stat`` when nothing changed.

Pure Python; used by both sides.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

#: Environment variable naming the channel directory (set by the server extension).
CHANNEL_ENV = "JUPYTER_VGPU_CHANNEL"

SERVER_FILE = "server.json"


def channel_dir(environ: dict[str, str] | None = None) -> Path | None:
    """The channel directory named by ``JUPYTER_VGPU_CHANNEL``, or None when unset."""
    environ = os.environ if environ is None else environ
    value = environ.get(CHANNEL_ENV)
    return Path(value) if value else None


def server_path(directory: Path) -> Path:
    """Path of the document the server writes for its kernels."""
    return directory / SERVER_FILE


def kernel_path(directory: Path, kernel_id: str) -> Path:
    """Path of the report kernel ``kernel_id`` writes for its server.

    Raises:
        ValueError: ``kernel_id`` would escape the directory.
    """
    if not kernel_id or "/" in kernel_id or "\\" in kernel_id or kernel_id.startswith("."):
        raise ValueError(f"invalid kernel id {kernel_id!r}")
    return directory / f"kernel-{kernel_id}.json"


def kernel_id_of(path: Path) -> str | None:
    """The kernel id in a report's file name, or None if ``path`` is not a report."""
    name = path.name
    if name.startswith("kernel-") and name.endswith(".json"):
        return name[len("kernel-") : -len(".json")] or None
    return None


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` to ``path`` atomically: readers see the old or the new file,
    never a partial one.

    Raises:
        OSError: the directory is not writable.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(document, f, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when the file is absent or not a JSON object."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None
