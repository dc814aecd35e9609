"""A stand-in for the driver's process checkpoint that records what it is asked, for
testing the arbiter's suspend and restore decisions on a machine without a GPU.

It has :mod:`jupyter_vgpu.host.checkpoint`'s interface (``state``, ``suspend``,
``restore``, ``NoRoom``, ``CheckpointError``) and moves nothing: it notes which
processes were suspended and says so when asked. The arbiter's checkpoint workers
(:mod:`jupyter_vgpu.node.checkpoint_pool`) use it instead of the driver. Every call is appended to the file
:data:`LOG` names, a JSON object a line: the call, the PIDs, and, read at that moment,
each process's uid and start time (None when gone). A test then sees exactly which
processes the arbiter would have handed to the driver.

The arbiter's workers use it only when the arbiter's own environment names the log in
``JUPYTER_VGPU_CHECKPOINT_STANDIN`` (set by whoever starts the arbiter: the admin, a
test; never a user).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable

from jupyter_vgpu.host.checkpoint import CheckpointError, NoRoom
from jupyter_vgpu.host.procs import start_time, uid_of

#: Environment variable naming the log; set in the arbiter's environment to use this module.
ENV = "JUPYTER_VGPU_CHECKPOINT_STANDIN"
#: The log's path (set by the arbiter's program from :data:`ENV`).
LOG = ""

__all__ = ["LOG", "CheckpointError", "NoRoom", "restore", "state", "suspend"]

_lock = threading.Lock()


def _note(call: str, pids: list[int]) -> None:
    entry = {
        "call": call,
        "pids": pids,
        "uids": [uid_of(p) for p in pids],
        "starts": [start_time(p) for p in pids],
    }
    with _lock, open(LOG, "a") as f:
        f.write(json.dumps(entry) + "\n")


def _pids(pids: int | Iterable[int]) -> list[int]:
    return [pids] if isinstance(pids, int) else list(pids)


def state(pid: int) -> str:
    """``checkpointed`` for a process the stand-in was last asked to suspend (by any of
    the arbiter's workers: the log says), else ``running``."""
    last = [c["call"] for c in calls(LOG) if pid in c["pids"] and c["call"] in ("suspend", "restore")]
    _note("state", [pid])
    return "checkpointed" if last and last[-1] == "suspend" else "running"


def suspend(pids: int | Iterable[int], timeout: float = 10.0) -> float:
    """Note the processes as suspended; 0 seconds."""
    _note("suspend", _pids(pids))
    return 0.0


def restore(pids: int | Iterable[int], need: dict[str, int] | None = None) -> float:
    """Note the processes as restored; 0 seconds."""
    _note("restore", _pids(pids))
    return 0.0


def calls(path: str) -> list[dict]:
    """The calls recorded in the log at ``path`` (none when it is missing)."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
