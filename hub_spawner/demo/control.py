"""``scripts/demo stop`` and ``scripts/demo clean``: end everything a demo started, and
remove everything it left.

``stop`` ends, for each demo state directory (:mod:`.settings`), in this order:

1. the Hub (its PID file): SIGTERM, on which the demo's Hub stops every user's server
   through its spawner (``cleanup_servers``: the server, its kernels, whatever is left in
   its cgroup, a Slurm job through ``scancel``), its proxy and its node arbiter;
2. the Slurm test cluster of the Slurm demo (``scripts/slurm-cluster stop``: its jobs,
   node arbiters, daemons, network namespaces and bridge);
3. whatever of the demo still runs, said by name: processes in the demo's cgroups (which
   none of them can leave), processes whose command line names the state directory (a
   node arbiter, Slurm's and munge's daemons, servers and kernels run by the demo's
   Python), and processes started for the demo (``JUPYTER_VGPU_DEMO_DIR``, or a server's
   environment in a home under it) -- after a Hub that was killed, nothing else would
   end them;
4. the demo's cgroups, removed.

``clean`` stops, then removes the system accounts the demo made (``<state>/accounts``),
the Slurm test cluster's leftovers, and the state directories themselves.

    python -m hub_spawner.demo.control stop|clean [STATE_DIR ...]

Without directories: both modes' defaults (``.vgpu-demo``, ``.vgpu-demo-slurm``) and
``JUPYTER_VGPU_DEMO_DIR``, those that exist. Exit status 1 when something could not be
ended or removed (said on stderr).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from jupyter_vgpu.host import procs

from . import settings, system_user

CHECKOUT = Path(__file__).resolve().parents[2]
SLURM_CLUSTER = CHECKOUT / "scripts" / "slurm-cluster"
#: The Slurm demo's cluster, inside its state directory.
CLUSTER = "cluster"


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def _describe(pid: int) -> str:
    return f"{pid} ({' '.join(procs.cmdline(pid))[:120] or '?'})"


def _pid_file(path: Path) -> int | None:
    try:
        pid = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if pid > 0 and procs.running(pid) else None


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    left = [p for p in pids if procs.running(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if procs.running(p)]
    return left


def _ancestors() -> set[int]:
    """This process and its ancestors (never ended: the shell that runs ``stop``)."""
    found, pid = set(), os.getpid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return found


def stop_hub(state: Path) -> None:
    """SIGTERM to the demo's Hub, and wait for it to stop its servers and exit."""
    pid = _pid_file(state / settings.HUB_PID)
    if pid is None or not any("jupyterhub" in a for a in procs.cmdline(pid)):
        return
    say(f"stopping the Hub (pid {pid}) and, through it, every user's server and kernel")
    os.kill(pid, signal.SIGTERM)
    if _wait_gone([pid], 120):
        say(f"the Hub (pid {pid}) did not stop within 120 s: killing it")
        os.kill(pid, signal.SIGKILL)
        _wait_gone([pid], 10)


def stop_cluster(state: Path) -> list[str]:
    """``scripts/slurm-cluster stop`` on the Slurm demo's cluster, when it has one."""
    cluster = state / CLUSTER
    if not cluster.is_dir():
        return []
    if (cluster / "pids").exists():
        say(f"stopping the Slurm test cluster in {cluster} (its jobs, node arbiters and daemons)")
    done = subprocess.run(
        ["bash", str(SLURM_CLUSTER), "stop", str(cluster)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        return [f"scripts/slurm-cluster stop {cluster} failed: {done.stderr.strip()[-500:]}"]
    return []


def _cgroup_dirs(parent: str) -> list[Path]:
    """The demo's cgroup parent in every hierarchy where it exists; never a hierarchy's
    root (a ``demo.json`` naming ``/`` or nothing names no cgroup of the demo's)."""
    from jupyter_vgpu.host import cgroups

    if not parent.strip("/"):
        return []
    found = []
    for mount in cgroups.mounts():
        top = mount.directory(parent)
        if top is not None and top.is_dir() and top != Path(mount.mountpoint):
            found.append(top)
    return found


def _cwd(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""


def _jupyter(pid: int) -> bool:
    """Whether ``pid`` runs a program of the demo's (JupyterHub, its proxy, a server, a
    kernel, an arbiter), not a shell or a tool that happens to share its environment."""
    line = " ".join(procs.cmdline(pid))
    return any(w in line for w in ("jupyter", "configurable-http-proxy", "ipykernel", "batchspawner"))


def leftovers(state: Path, meta: dict) -> list[int]:
    """PIDs of the processes the demo in ``state`` started that still run."""
    from jupyter_vgpu.host import cgroups

    mine = _ancestors()
    found: set[int] = set()
    parent = meta.get("cgroup_parent")
    if parent:
        for top in _cgroup_dirs(parent):
            for directory in [top, *(p for p in top.rglob("*") if p.is_dir())]:
                found.update(cgroups.procs(directory))
    root = str(state)
    homes = str(state / "users") + "/"
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid in mine or pid in found:
            continue
        if "hub_spawner.demo.control" in procs.cmdline(pid):
            continue  # another `scripts/demo stop` (Ctrl-C's, beside one typed elsewhere)
        if any(root + "/" in arg or arg.endswith(root) for arg in procs.cmdline(pid)):
            found.add(pid)
            continue
        env = procs.environ(pid)
        demo = env.get("JUPYTER_VGPU_DEMO_DIR")
        if demo and Path(demo).resolve() == state and _jupyter(pid):
            found.add(pid)  # the Hub, its proxy (a shell that exported the variable is not)
        elif _cwd(pid).startswith(homes) and env.get("JUPYTERHUB_USER"):
            found.add(pid)  # a user's server or kernel (a user's shell has no JUPYTERHUB_USER)
    return sorted(p for p in found if p not in mine and procs.running(p))


def end_leftovers(state: Path, meta: dict) -> list[str]:
    """End what the demo left running (SIGTERM, then SIGKILL), saying what; returns what
    could not be ended."""
    pids = leftovers(state, meta)
    if not pids:
        return []
    say(f"ending {len(pids)} process(es) of the demo that still ran:")
    for pid in pids:
        say(f"  {_describe(pid)}")
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for pid in _wait_gone(pids, 10):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return [f"process {_describe(p)} would not end" for p in _wait_gone(pids, 10)]


def remove_cgroups(meta: dict) -> list[str]:
    """Remove the demo's cgroups (their processes ended first), and its systemd slice."""
    from hub_spawner.server_cgroup import kill_all

    problems = []
    slice_unit = meta.get("systemd_slice")
    if slice_unit and os.path.isdir("/run/systemd/system") and shutil.which("systemctl"):
        subprocess.run(["systemctl", "stop", slice_unit], capture_output=True, check=False)
    parent = meta.get("cgroup_parent")
    if not parent:
        return problems
    for top in _cgroup_dirs(parent):
        below = [top, *(p for p in top.rglob("*") if p.is_dir())]
        for directory in sorted(below, key=lambda p: -len(p.parts)):
            kill_all(directory)
            deadline = time.monotonic() + 10
            while True:
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if time.monotonic() > deadline:
                        problems.append(f"cannot remove the cgroup {directory}: {e}")
                        break
                    kill_all(directory, rounds=1)
                    time.sleep(0.2)
        try:
            top.parent.rmdir()  # /jupyter-vgpu-demo, when no other demo uses it
        except OSError:
            pass
    return problems


def stop(state: Path) -> list[str]:
    """Everything of the demo in ``state`` ended (see the module's docstring); returns
    what could not be. One stop at a time per state directory: a second one (Ctrl-C's,
    beside one typed in another terminal) waits for the first, then finds nothing."""
    import fcntl

    with open(state / ".stop.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _stop(state)


def _stop(state: Path) -> list[str]:
    meta = settings.read_meta(state)
    stop_hub(state)
    problems = stop_cluster(state)
    problems += end_leftovers(state, meta)
    problems += remove_cgroups(meta)
    for name in (settings.HUB_PID, "proxy.pid"):
        path = state / name
        if path.exists() and _pid_file(path) is None:
            path.unlink()
    return problems


def clean(state: Path) -> list[str]:
    """:func:`stop`, then the demo's accounts, its Slurm leftovers and its state, removed."""
    problems = stop(state)
    if problems:
        return [*problems, f"{state} is kept: something of it still runs"]
    made = system_user.recorded(state / settings.ACCOUNTS)
    removed, kept = system_user.remove(made)
    if removed:
        say(f"removed the system accounts the demo made: {', '.join(removed)}")
    problems += [f"account {k}" for k in kept]
    shutil.rmtree(state, ignore_errors=True)
    if state.exists():
        problems.append(f"cannot remove {state}")
    else:
        say(f"removed {state}")
    return problems


def states(given: list[str]) -> list[Path]:
    """The state directories to act on: those given, else the existing ones of both modes
    (and ``JUPYTER_VGPU_DEMO_DIR``)."""
    if given:
        return [Path(g).resolve() for g in given]
    candidates = [Path(d).resolve() for d in settings.DEFAULT_DIRS.values()]
    if os.environ.get("JUPYTER_VGPU_DEMO_DIR"):
        candidates.append(Path(os.environ["JUPYTER_VGPU_DEMO_DIR"]).resolve())
    return [p for p in dict.fromkeys(candidates) if p.is_dir()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("stop", "clean"):
        print("usage: python -m hub_spawner.demo.control stop|clean [STATE_DIR ...]", file=sys.stderr)
        return 2
    action, given = argv[0], argv[1:]
    found = states(given)
    if not found:
        say("no demo state here: nothing runs, nothing to remove")
        return 0
    problems = []
    for state in found:
        if not state.is_dir():
            continue
        problems += stop(state) if action == "stop" else clean(state)
    for p in problems:
        print(f"[demo] {p}", file=sys.stderr)
    if not problems:
        say("stopped: nothing of the demo runs" if action == "stop" else "clean: nothing of the demo is left")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
