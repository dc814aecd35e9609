"""A stand-in for the driver's process checkpoint that records what it is asked, for
testing the arbiter's suspend and restore decisions on a machine without a GPU.

It has :mod:`jupyter_vgpu.node.checkpoint`'s interface (``state``, ``suspend``,
``restore``, ``NoRoom``, ``CheckpointError``) and moves nothing: it notes which
processes were suspended and says so when asked. Every call is appended to the file
:data:`LOG` names, a JSON object a line: the call, the PIDs, and, read at that moment,
each process's uid and start time (None when gone). A test then sees exactly which
processes the arbiter would have handed to the driver.

The arbiter uses it only when its own environment names the log in
``JUPYTER_VGPU_CHECKPOINT_STANDIN`` (set by whoever starts the arbiter: the admin, a
test; never a user).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable

from jupyter_vgpu.node.checkpoint import CheckpointError, NoRoom
from jupyter_vgpu.node.procs import start_time, uid_of

#: Environment variable naming the log; set in the arbiter's environment to use this module.
ENV = "JUPYTER_VGPU_CHECKPOINT_STANDIN"
#: The log's path (set by the arbiter's program from :data:`ENV`).
LOG = ""

__all__ = ["LOG", "CheckpointError", "NoRoom", "restore", "state", "suspend"]

_held: set[int] = set()
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
    """``checkpointed`` for a process this stand-in suspended, else ``running``."""
    _note("state", [pid])
    return "checkpointed" if pid in _held else "running"


def suspend(pids: int | Iterable[int], timeout: float = 10.0) -> float:
    """Note the processes as suspended; 0 seconds."""
    group = _pids(pids)
    _note("suspend", group)
    _held.update(group)
    return 0.0


def restore(pids: int | Iterable[int], need: dict[str, int] | None = None) -> float:
    """Note the processes as restored; 0 seconds."""
    group = _pids(pids)
    _note("restore", group)
    _held.difference_update(group)
    return 0.0


def calls(path: str) -> list[dict]:
    """The calls recorded in the log at ``path`` (none when it is missing)."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
