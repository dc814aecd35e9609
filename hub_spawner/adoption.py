"""A Hub started again and the servers its database says are running: it adopts those it
can, ends those it cannot, and says which.

JupyterHub asks each spawner whose server the database lists as running to ``poll()``
it: a server still running (``None``) is adopted; any other answer is logged as "appears
to have stopped while the Hub was down" and the server is stopped through its spawner.
That holds as long as the spawner that reads the state is the kind that wrote it. A Hub
whose spawner changed (the demo's Slurm Hub on the local demo's database, an admin who
moved from ``vgpu`` to ``vgpu-slurm``) reads another kind's state: its spawner finds no
job, or no process, says "stopped", and the server goes on running, unmanaged, with its
kernels and GPU memory.

So every spawner of ours writes its kind into its state (:data:`KIND_KEY`), and a
spawner that loads another kind's running server ends it (:func:`end`) in its ``poll()``,
before JupyterHub's own clean-up, and logs what it ended: a local server's cgroup and
process, a Slurm job (``scancel``). State written before the kind was recorded is told
by its keys (``pid``: a local process; ``job_id``: a batch job).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from typing import Any

from jupyter_vgpu.host import procs

#: The spawner state's key naming the kind of spawner that started the server.
KIND_KEY = "vgpu_spawner"
#: Servers this Hub ended because it could not adopt them, by their spawner's log name.
ended: set[str] = set()


def kind_of(state: dict[str, Any]) -> str | None:
    """The kind of spawner that wrote ``state`` while its server ran (``local``,
    ``slurm``, ``kube``), or None when ``state`` holds no running server. Our spawners
    write :data:`KIND_KEY` while their server runs; older state is told by a ``pid``
    (a local process) or a ``job_id`` (a batch job)."""
    kind = state.get(KIND_KEY)
    if isinstance(kind, str) and kind:
        return kind
    if state.get("pid"):
        return "local"
    if state.get("job_id"):
        return "slurm"
    return None


def _is_server_of(pid: int, user: str) -> bool:
    """Whether ``pid`` still runs a Jupyter server of ``user`` (its environment says so:
    a PID handed out again to another process does not)."""
    return procs.environ(pid).get("JUPYTERHUB_USER") == user


def _end_local(state: dict[str, Any], user: str) -> str:
    from jupyter_vgpu.host import cgroups

    from .server_cgroup import kill_all

    done = []
    saved = state.get("vgpu_cgroup")
    if isinstance(saved, dict) and isinstance(saved.get("path"), str):
        mount = cgroups.find_mount(str(saved.get("hierarchy") or cgroups.V2))
        directory = mount.directory(saved["path"]) if mount is not None else None
        if directory is not None and directory.is_dir():
            try:
                n = kill_all(directory)
            except ValueError as e:  # a saved path that names a hierarchy's root
                return f"not ended: {e}"
            deadline = time.monotonic() + 10  # its processes' last moments keep it busy
            while directory.exists():
                try:
                    directory.rmdir()
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        done.append(f"(its cgroup {saved['path']} is still busy: left for the next stop)")
                        break
                    kill_all(directory, rounds=1)
                    time.sleep(0.2)
            done.append(f"{n} process(es) in its cgroup {saved['path']}")
    pid = state.get("pid")
    if isinstance(pid, int) and pid > 0 and _is_server_of(pid, user):
        try:
            os.kill(pid, signal.SIGTERM)  # a Jupyter server shuts its kernels down on SIGTERM
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _is_server_of(pid, user):
                time.sleep(0.1)
            if _is_server_of(pid, user):
                os.kill(pid, signal.SIGKILL)
            done.append(f"its process {pid}")
        except ProcessLookupError:
            pass
    return "ended " + " and ".join(done) if done else "nothing of it runs any more"


def _end_slurm(state: dict[str, Any]) -> str:
    job = str(state.get("job_id") or "")
    if not job:
        return "it names no job"
    if shutil.which("scancel") is None:
        return f"cannot end its Slurm job {job} here (no scancel): cancel it with `scancel {job}`"
    r = subprocess.run(["scancel", job], capture_output=True, text=True, timeout=30, check=False)
    if r.returncode != 0:
        said = r.stderr.strip() or f"exit status {r.returncode}"
        return f"scancel {job} failed ({said}): cancel it by hand"
    return f"cancelled its Slurm job {job}"


def end(
    state: dict[str, Any], kind: str, user: str, log_name: str, this_kind: str, log: logging.Logger
) -> None:
    """End a running server that a spawner of ``kind`` started and this Hub's spawner (of
    ``this_kind``) cannot adopt, and log what was done."""
    if kind == "local":
        what = _end_local(state, user)
    elif kind == "slurm":
        what = _end_slurm(state)
    else:
        what = f"a {kind} server cannot be ended from here: end it by hand"
    ended.add(log_name)
    log.warning(
        "jupyter-vgpu: %s's server was started by a %s spawner and is still listed as running; this Hub's "
        "%s spawner cannot adopt it, so it is ended, not left running unmanaged: %s",
        log_name,
        kind,
        this_kind,
        what,
    )


class StoppedNote(logging.Filter):
    """Says "ended: this Hub could not adopt it" instead of JupyterHub's "appears to have
    stopped while the Hub was down" for the servers :func:`end` ended."""

    def filter(self, record: logging.LogRecord) -> bool:
        if (
            "appears to have stopped while the Hub was down" in str(record.msg)
            and record.args
            and record.args[0] in ended
        ):
            record.msg = "%s's server was ended: this Hub could not adopt it (see the warning above)"
        return True
