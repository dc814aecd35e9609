"""What a restarted arbiter cannot learn from anyone else: slices registered over its socket.

Everything else in the books is held by a process that outlives the arbiter: kernels
say their state and figures in their hello (:mod:`.protocol`), the Hub holds the slices
of its servers (``GET /hub/api/vgpu/slices``), the driver holds the checkpoint state of
every suspended process (``cuCheckpointProcessGetState``). A slice registered over the
socket by a trusted client (a standalone arbiter's benchmark or test harness) is known
to the arbiter alone, and that client may be long gone. This journal keeps those
registrations in a JSON file beside the socket (written whole to a temporary file,
then renamed, mode 0600), with each root process's start time, so that a registration
whose process has ended (or whose PID was handed out again) is dropped at load.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from jupyter_vgpu.host.procs import start_time
from jupyter_vgpu.slice import Slice, SliceError

log = logging.getLogger("jupyter_vgpu.node")


class Journal:
    """Registrations over the socket, in ``path``.

    Args:
        path: the journal file (beside the socket, in the arbiter's own directory).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.entries: dict[int, dict] = {}  # root pid -> entry

    def load(self) -> list[tuple[int, str, str, Slice, int, int | None]]:
        """``(pid, user, server, slice, start, uid)`` of every journaled registration whose
        process still runs (``start``: its start time, clock ticks after boot; ``uid``: the
        account it runs as, or None); the others are forgotten (and the file rewritten
        without them)."""
        try:
            entries = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            log.error("the journal %s cannot be read (%s); starting without it", self.path, e)
            return []
        out = []
        for e in entries if isinstance(entries, list) else []:
            try:
                pid, started = int(e["pid"]), int(e["start"])
                uid = int(e["uid"]) if e.get("uid") is not None else None
                slice_ = Slice.from_dict(e["slice"])
            except (KeyError, TypeError, ValueError, SliceError):
                continue
            if start_time(pid) != started:
                continue  # that server has ended
            self.entries[pid] = e
            out.append((pid, str(e.get("user", "")), str(e.get("server", "")), slice_, started, uid))
        self._save()
        return out

    def add(
        self,
        pid: int,
        user: str,
        server: str,
        slice_: Slice,
        start: int | None = None,
        uid: int | None = None,
    ) -> None:
        """Keep a registration: the process ``pid`` as it started (``start``, read now
        where not given) and the account it runs as (``uid``, or None)."""
        started = start if start is not None else start_time(pid)
        if started is None:
            return
        self.entries[pid] = {
            "pid": pid,
            "start": started,
            "uid": uid,
            "user": user,
            "server": server,
            "slice": slice_.to_dict(),
        }
        self._save()

    def remove(self, pid: int) -> None:
        if self.entries.pop(pid, None) is not None:
            self._save()

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(list(self.entries.values()), f)
            os.replace(tmp, self.path)
        except OSError as e:
            log.error("the journal %s cannot be written: %s", self.path, e)
