"""Each local server in a cgroup of its own, which its user cannot leave.

The node arbiter knows a GPU process's server by the cgroup it is in
(:mod:`jupyter_vgpu.host.cgroups`): a process can leave its process tree (a double
fork, ``setsid``, ``nohup … & disown``, a daemonizing tool), not its cgroup, when the
cgroup's directories belong to root. :class:`ServerCgroupMixin` gives the local
spawners (``VGPUSpawner``, ``VGPUSimpleSpawner``, the demo's) one cgroup per server:

- ``cgroupfs`` (the default where systemd does not run the host): the Hub, as root,
  makes a directory for the server under ``cgroup_parent`` in the unified hierarchy
  (cgroup v2: ``/sys/fs/cgroup``, or ``/sys/fs/cgroup/unified`` on a "hybrid" host),
  else in a v1 hierarchy (``cgroup_v1_hierarchy``, default the first of ``pids``,
  ``name=systemd``, ``freezer``, ``cpu``, ``memory`` mounted read-write). The child
  process writes its PID into the directory's ``cgroup.procs`` in its ``preexec_fn``,
  as root, before it drops its privileges and execs the server: no code of the user's
  runs outside it. The directory and its files stay root's (``0755``/``0644``), so the
  user's processes cannot move out (moving needs write access to ``cgroup.procs`` of
  the destination and of the common ancestor).
- ``systemd`` (the default where systemd runs the host): the server's command runs
  through ``systemd-run --scope`` (a transient scope unit in the slice
  ``cgroup_systemd_slice``, as JupyterHub's SystemdSpawner runs each server through
  ``systemd-run``), then ``setpriv`` drops to the user's account with its groups; the
  scope's cgroup is ``/<slice>/<unit>``. systemd owns the hierarchy there, so the Hub
  does not write into it by hand.
- ``off``: no cgroup; the arbiter falls back to the process tree.

Where no cgroup can be made (the Hub is not root, no hierarchy is mounted read-write,
``systemd-run`` or ``setpriv`` is missing), servers run without one, the arbiter maps
their processes by process tree, and the Hub's ``/hub/vgpu`` page says so for this
host, with the reason (:func:`host_status`).

When a server stops, or its process is found gone, everything left in its cgroup is
killed (``cgroup.kill``, or SIGKILL to each process until it is empty) and the cgroup
removed: a stopped server leaves no process behind, daemons included.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from traitlets import Enum, HasTraits, Unicode

from jupyter_vgpu.host import cgroups, procs
from jupyter_vgpu.host.cgroups import V2, Cgroup

#: Where the server's cgroup is remembered in the spawner's state (survives Hub restarts).
STATE_KEY = "vgpu_cgroup"
#: v1 hierarchies tried in order when no unified hierarchy is mounted.
V1_PREFERENCE = ["pids", "name=systemd", "freezer", "cpu", "memory"]
MODES = ("auto", "cgroupfs", "systemd", "off")


class CgroupUnavailable(RuntimeError):
    """No cgroup can be made for servers here; the message says why."""


@dataclasses.dataclass(frozen=True)
class Host:
    """How this Hub puts servers in cgroups.

    Attributes:
        mode: ``cgroupfs`` or ``systemd`` (``off``/None ``where`` when there are none).
        hierarchy: the hierarchy used (:data:`~jupyter_vgpu.host.cgroups.V2` or a v1 name).
        parent: the cgroup path servers' cgroups go under (cgroupfs), or the slice's
            cgroup (systemd).
        mount: where that hierarchy is mounted here.
    """

    mode: str
    hierarchy: str
    parent: str
    mount: cgroups.Mount

    def describe(self) -> str:
        where = (
            "the unified hierarchy (cgroup v2)"
            if self.hierarchy == V2
            else f"the v1 hierarchy {self.hierarchy}"
        )
        how = "transient systemd scopes" if self.mode == "systemd" else "directories the Hub makes"
        return f"each server runs in a cgroup of its own under {self.parent} in {where} ({how})"


def _safe(text: str, limit: int = 48) -> str:
    """``text`` as a piece of a cgroup or unit name: letters, digits, ``_`` and ``-``."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)[:limit] or "_"


def probe(
    mode: str = "auto",
    parent: str = "/jupyter-vgpu",
    v1_hierarchy: str = "",
    systemd_slice: str = "jupyter_vgpu.slice",
    *,
    euid: int | None = None,
    found: list[cgroups.Mount] | None = None,
    systemd: bool | None = None,
) -> Host:
    """Where servers' cgroups go on this host.

    Args:
        mode: one of :data:`MODES`.
        parent: cgroupfs: the cgroup servers' cgroups are made under (made if missing).
        v1_hierarchy: cgroupfs without a unified hierarchy: the v1 hierarchy to use
            ("" tries :data:`V1_PREFERENCE`).
        systemd_slice: systemd: the slice unit scopes go in.
        euid, found, systemd: this process's effective uid, cgroup mounts, and whether
            systemd runs the host (read from the system when None).

    Raises:
        CgroupUnavailable: none can be made here, or ``mode`` is ``off``; the message
            says why.
    """
    if mode not in MODES:
        raise ValueError(f"cgroup mode must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "off":
        raise CgroupUnavailable("per-server cgroups are switched off (ServerCgroupMixin.cgroup_mode = 'off')")
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        raise CgroupUnavailable(
            f"the Hub runs as uid {euid}, not root: only root can make cgroups that servers' users "
            "cannot leave"
        )
    found = cgroups.mounts() if found is None else found
    if systemd is None:
        systemd = os.path.isdir("/run/systemd/system")
    if mode == "auto":
        mode = "systemd" if systemd else "cgroupfs"
    if mode == "systemd":
        missing = [tool for tool in ("systemd-run", "setpriv") if shutil.which(tool) is None]
        if missing:
            raise CgroupUnavailable(f"systemd scopes need {' and '.join(missing)}, not found on PATH")
        mount = cgroups.find_mount(V2, found) or cgroups.find_mount("name=systemd", found)
        if mount is None:
            raise CgroupUnavailable("systemd's cgroup hierarchy is not mounted here")
        return Host("systemd", mount.hierarchy, "/" + _slice_path(systemd_slice), mount)
    parent = Cgroup.parse_name(parent).path
    candidates = [m for m in found if m.hierarchy == V2]
    if not candidates:
        names = [v1_hierarchy] if v1_hierarchy else V1_PREFERENCE
        candidates = [m for n in names if (m := cgroups.find_mount(n, found)) is not None]
    candidates = [m for m in candidates if m.writable and m.directory(parent) is not None]
    if not candidates:
        mounted = ", ".join(sorted({m.hierarchy for m in found})) or "none"
        raise CgroupUnavailable(
            f"no cgroup hierarchy is mounted read-write here with {parent} in reach (mounted: {mounted})"
        )
    mount = candidates[0]
    directory = mount.directory(parent)
    try:
        directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        trial = directory / f"probe-{secrets.token_hex(4)}"
        trial.mkdir(mode=0o755)
        trial.rmdir()
    except OSError as e:
        raise CgroupUnavailable(f"cannot make cgroups under {directory}: {e}") from None
    return Host("cgroupfs", mount.hierarchy, parent, mount)


def _slice_path(unit: str) -> str:
    """The cgroup path of a systemd slice relative to the root: ``a-b.slice`` is
    ``a.slice/a-b.slice`` (each dash a level, systemd.slice(5))."""
    stem = unit.removesuffix(".slice")
    parts = stem.split("-")
    return "/".join("-".join(parts[: i + 1]) + ".slice" for i in range(len(parts)))


def unit_name(user: str, server: str, token: str) -> str:
    """The transient scope unit of a server (names safe for systemd: no escapes needed)."""
    return f"jupyter-vgpu-{_safe(user)}-{_safe(server or 'default', 32)}-{token}.scope"


def scope_command(
    unit: str, slice_unit: str, account: tuple[int, int] | None, cmd: list[str], workdir: str
) -> list[str]:
    """``cmd`` run in the transient scope ``unit`` (``systemd-run --scope``), as the
    account ``(uid, gid)`` with its groups (``setpriv --init-groups``), or as the Hub's
    own user when ``account`` is None."""
    run = [
        "systemd-run",
        "--scope",
        "--quiet",
        "--collect",
        f"--unit={unit}",
        f"--slice={slice_unit}",
        f"--working-directory={workdir}",
        "--property=KillMode=control-group",
        "--",
    ]
    if account is not None:
        run += ["setpriv", f"--reuid={account[0]}", f"--regid={account[1]}", "--init-groups", "--"]
    return run + list(cmd)


def joiner(directory: Path):
    """A ``preexec_fn`` step: move the calling (child) process into the cgroup at ``directory``."""
    procs = str(directory / "cgroup.procs")

    def join() -> None:
        fd = os.open(procs, os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    return join


def kill_all(directory: Path, rounds: int = 50) -> int:
    """End every process in the cgroup at ``directory`` (SIGKILL; ``cgroup.kill`` where
    the kernel has it, Linux 5.14+); returns how many PIDs were seen in it. Processes
    forking while they are killed are caught by the next round, up to ``rounds`` of them
    (about 1 s).

    Raises:
        ValueError: ``directory`` is a hierarchy's root cgroup (every process of the
            host), which is never a server's.
    """
    directory = Path(directory)
    if (directory / "cgroup.procs").exists() and not (directory.parent / "cgroup.procs").exists():
        raise ValueError(f"{directory} is a cgroup hierarchy's root: refusing to end every process in it")
    seen: set[int] = set()
    kill_file = directory / "cgroup.kill"
    for _ in range(rounds):
        pids = cgroups.procs(directory)
        if not pids:
            break
        seen.update(pids)
        if kill_file.exists():
            try:
                kill_file.write_text("1")
            except OSError:
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)
    return len(seen)


class ServerCgroupMixin(HasTraits):
    """Puts each server of a local spawner in a cgroup of its own (see the module's
    docstring). Put it first in the bases, before ``VGPUSpawnerMixin``."""

    cgroup_mode = Enum(
        list(MODES),
        default_value="auto",
        help="""How each server gets a cgroup its user cannot leave, by which the node arbiter
        knows every process of the server, daemons included. 'cgroupfs': the Hub (root)
        makes one under cgroup_parent, in the unified hierarchy (cgroup v2) where it is
        mounted, else in a v1 hierarchy. 'systemd': a transient systemd scope per server
        (systemd-run --scope, then setpriv to the user). 'auto' (default): 'systemd' where
        systemd runs the host, 'cgroupfs' elsewhere. 'off': none; the arbiter maps processes
        by process tree, which daemons leave. Where none can be made (the Hub is not root,
        no writable hierarchy), servers run without and the /hub/vgpu page says why.""",
    ).tag(config=True)

    cgroup_parent = Unicode(
        "/jupyter-vgpu",
        help="""cgroupfs mode: the cgroup (path from the hierarchy's root, as
        /proc/self/cgroup shows paths) under which each server's cgroup is made. On a host
        whose cgroups systemd manages, point it into a cgroup delegated to the Hub
        (Delegate=yes in the Hub's unit), or use the 'systemd' mode.""",
    ).tag(config=True)

    cgroup_v1_hierarchy = Unicode(
        "",
        help=f"""cgroupfs mode on a host without the unified hierarchy: the v1 hierarchy
        to use ('pids', 'name=systemd', ...). Default: the first of {", ".join(V1_PREFERENCE)}
        mounted read-write.""",
    ).tag(config=True)

    cgroup_systemd_slice = Unicode(
        "jupyter_vgpu.slice", help="systemd mode: the slice unit servers' scopes go in."
    ).tag(config=True)

    #: The running server's cgroup, or None (none could be made, or not running).
    vgpu_cgroup: Cgroup | None = None
    _cgroup_unit: str = ""
    #: The start time of the server's process (clock ticks after boot) and the uid of the
    #: account it runs as, recorded as it started: the node arbiter gives the slice to that
    #: very process (a PID that changed hands since gets none) and admits as its kernels
    #: only processes of that uid.
    vgpu_server_start: int | None = None
    vgpu_server_uid: int | None = None

    def cgroup_host(self) -> tuple[Host | None, str | None]:
        """``(host, None)`` where servers get cgroups, ``(None, why not)`` elsewhere
        (:func:`host_for`)."""
        return host_for(
            (self.cgroup_mode, self.cgroup_parent, self.cgroup_v1_hierarchy, self.cgroup_systemd_slice),
            self.log,
        )

    def cgroup_account(self) -> tuple[int, int] | None:
        """``(uid, gid)`` of the account the server runs as, for the systemd mode's
        ``setpriv``; None: the Hub's own user (``SimpleLocalProcessSpawner``)."""
        from jupyterhub.spawner import SimpleLocalProcessSpawner

        if isinstance(self, SimpleLocalProcessSpawner):
            return None
        import pwd

        account = pwd.getpwnam(self.user.name)
        return account.pw_uid, account.pw_gid

    def cgroup_workdir(self) -> str:
        """systemd mode: the directory the server starts in (the user's home)."""
        home = getattr(self, "home_dir", "")  # SimpleLocalProcessSpawner's
        if home:
            return home
        import pwd

        try:
            return pwd.getpwnam(self.user.name).pw_dir
        except KeyError:
            return "/"

    def cgroup_prepare(self) -> None:
        """systemd mode: what the child does as root before ``systemd-run`` (nothing here;
        the privileges are dropped by ``setpriv`` after the scope is made)."""

    def cgroup_directory(self) -> Path | None:
        """The running server's cgroup directory here, or None."""
        host, _ = self.cgroup_host()
        if self.vgpu_cgroup is None or host is None:
            return None
        mount = cgroups.find_mount(self.vgpu_cgroup.hierarchy)
        return mount.directory(self.vgpu_cgroup.path) if mount is not None else None

    def make_preexec_fn(self, name):
        inner = super().make_preexec_fn(name)
        host, _ = self.cgroup_host()
        if self.vgpu_cgroup is None or host is None:
            return inner
        if host.mode == "systemd":
            return self.cgroup_prepare
        join = joiner(self.cgroup_directory())

        def preexec():  # in the child, as the Hub's user (root), before exec
            join()
            inner()

        return preexec

    async def start(self):
        host, _ = self.cgroup_host()
        self.vgpu_cgroup = None
        if host is not None:
            token = secrets.token_hex(4)
            if host.mode == "systemd":
                self._cgroup_unit = unit_name(self.user.name, self.name, token)
                self.vgpu_cgroup = Cgroup(host.hierarchy, f"{host.parent}/{self._cgroup_unit}")
            else:
                leaf = f"{_safe(self.user.name)}-{_safe(self.name or 'default', 32)}-{token}"
                self.vgpu_cgroup = Cgroup(host.hierarchy, f"{host.parent.rstrip('/')}/{leaf}")
                directory = self.cgroup_directory()
                try:
                    directory.mkdir(mode=0o755, parents=True)
                    directory.chmod(0o755)
                except OSError as e:
                    self.vgpu_cgroup = None
                    raise RuntimeError(f"cannot make the server's cgroup {directory}: {e}") from None
        saved = self.cmd
        if host is not None and host.mode == "systemd":
            workdir = self.cgroup_workdir()
            self.cmd = scope_command(
                self._cgroup_unit, self.cgroup_systemd_slice, self.cgroup_account(), list(saved), workdir
            )
        try:
            started = await super().start()
            self._record_server()
            return started
        except subprocess.SubprocessError as e:
            self.cgroup_release()
            raise RuntimeError(f"the server could not join its cgroup {self.vgpu_cgroup}: {e}") from None
        except BaseException:
            self.cgroup_release()
            raise
        finally:
            self.cmd = saved

    def _record_server(self) -> None:
        """Note the server's process as it started (:attr:`vgpu_server_start`,
        :attr:`vgpu_server_uid`). The Hub's own child, not yet reaped, cannot have handed
        its PID to another process; the uid is the account it was started as, not what
        ``/proc`` says (``setpriv`` may not have dropped to it yet)."""
        pid = getattr(self, "pid", 0) or 0
        self.vgpu_server_start = procs.start_time(pid) if pid else None
        account = self.cgroup_account()
        self.vgpu_server_uid = account[0] if account is not None else os.geteuid()

    async def poll(self):
        """The base spawner's answer; and for a server loaded from the database (a Hub
        started again), whose process the Hub knows by its PID alone, that PID must still
        be in the server's cgroup: a PID handed out again to another process is not the
        server (nor is one that started at another time than the one recorded), which is then
        reported stopped (whatever is left in its cgroup ended) and never signalled."""
        status = await super().poll()
        if status is not None or getattr(self, "proc", None) is not None or not getattr(self, "pid", 0):
            return status
        directory = self.cgroup_directory()
        if directory is None:
            return status
        started = self.vgpu_server_start
        same = started is None or procs.start_time(self.pid) == started
        if same and self.pid in cgroups.procs(directory):
            return None
        self.log.warning(
            "jupyter-vgpu: %s's server process %d is not in its cgroup %s any more (the PID belongs to "
            "another process now): the server is gone, and that process is left alone",
            self._log_name,
            self.pid,
            self.vgpu_cgroup,
        )
        self.pid = 0
        self.clear_state()
        return 0

    async def stop(self, now=False):
        try:
            return await super().stop(now=now)
        finally:
            self.cgroup_release()

    def clear_state(self) -> None:
        super().clear_state()
        self.vgpu_server_start = self.vgpu_server_uid = None
        self.cgroup_release()

    def cgroup_release(self) -> None:
        """End whatever is left in the server's cgroup and remove it (a retry runs in the
        background while it is still busy)."""
        directory = self.cgroup_directory()
        cgroup, self.vgpu_cgroup = self.vgpu_cgroup, None
        if directory is None or not directory.exists():
            return
        left = kill_all(directory)
        if left:
            self.log.info(
                "jupyter-vgpu: ended %d process(es) left in %s's cgroup %s", left, self._log_name, cgroup
            )
        host, _ = self.cgroup_host()
        if host is not None and host.mode == "systemd":
            return  # systemd collects the empty scope (--collect)
        try:
            directory.rmdir()
        except OSError:
            task = asyncio.ensure_future(_remove_later(directory, self.log))
            _pending.add(task)
            task.add_done_callback(_pending.discard)

    def vgpu_listing(self) -> dict[str, Any]:
        listing = super().vgpu_listing()
        _host, why = self.cgroup_host()
        cgroup = self.vgpu_cgroup
        listing.update(
            {
                "cgroup": cgroup.path if cgroup else None,
                "cgroup_hierarchy": cgroup.hierarchy if cgroup else None,
                "cgroup_problem": None if cgroup else (why or "the server started without one"),
                "start_time": self.vgpu_server_start,
                "uid": self.vgpu_server_uid,
            }
        )
        return listing

    def get_state(self):
        state = super().get_state()
        if self.vgpu_server_start is not None:
            state["vgpu_server"] = {"start": self.vgpu_server_start, "uid": self.vgpu_server_uid}
        if self.vgpu_cgroup is not None:
            state[STATE_KEY] = {
                "hierarchy": self.vgpu_cgroup.hierarchy,
                "path": self.vgpu_cgroup.path,
                "unit": self._cgroup_unit,
            }
        return state

    def load_state(self, state):
        super().load_state(state)
        server = state.get("vgpu_server")
        if isinstance(server, dict):
            start, uid = server.get("start"), server.get("uid")
            self.vgpu_server_start = start if isinstance(start, int) and not isinstance(start, bool) else None
            self.vgpu_server_uid = uid if isinstance(uid, int) and not isinstance(uid, bool) else None
        saved = state.get(STATE_KEY)
        if isinstance(saved, dict) and isinstance(saved.get("path"), str):
            try:
                self.vgpu_cgroup = Cgroup(
                    str(saved.get("hierarchy") or V2), Cgroup.parse_name(saved["path"]).path
                )
                self._cgroup_unit = str(saved.get("unit") or "")
            except ValueError as e:
                self.log.error("Dropping unusable saved cgroup of %s: %s", self._log_name, e)


_pending: set[asyncio.Task] = set()  # removals still waiting for their cgroup to empty


async def _remove_later(directory: Path, log, seconds: float = 10.0) -> None:
    """Remove a cgroup once its last processes are gone (retries for ``seconds``)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        kill_all(directory, rounds=1)
        if cgroups.try_remove(directory):
            return
        await asyncio.sleep(0.2)
    log.warning("jupyter-vgpu: could not remove the cgroup %s: processes are still in it", directory)


_hosts: dict[tuple, tuple[Host | None, str | None]] = {}


def host_for(settings: tuple[str, str, str, str], log) -> tuple[Host | None, str | None]:
    """:func:`probe` with ``settings`` (mode, parent, v1 hierarchy, systemd slice), once
    per Hub process: ``(host, None)``, or ``(None, why not)``, logged the first time."""
    if settings not in _hosts:
        try:
            host = probe(*settings)
            _hosts[settings] = (host, None)
            log.info("jupyter-vgpu: %s", host.describe())
        except CgroupUnavailable as e:
            _hosts[settings] = (None, str(e))
            log.warning(
                "jupyter-vgpu: servers run without a cgroup of their own (the node arbiter maps their "
                "processes by process tree, which daemons can leave): %s",
                e,
            )
    return _hosts[settings]


def host_status(spawner_class, config, log) -> dict[str, Any]:
    """What the Hub page says about cgroups on this host, for ``spawner_class`` under
    ``config`` (the Hub's): ``{"mode", "describe", "problem"}``; all None for spawners
    without per-server cgroups (Kubernetes: the pod's cgroup; others: unknown)."""
    if not (isinstance(spawner_class, type) and issubclass(spawner_class, ServerCgroupMixin)):
        return {"mode": None, "describe": None, "problem": None}
    names = ("cgroup_mode", "cgroup_parent", "cgroup_v1_hierarchy", "cgroup_systemd_slice")
    values = {n: spawner_class.class_traits()[n].default_value for n in names}
    for section in spawner_class.section_names():  # as traitlets resolves a class's config
        if section in config:
            values.update({n: config[section][n] for n in names if n in config[section]})
    host, why = host_for(tuple(values[n] for n in names), log)
    return {
        "mode": host.mode if host else None,
        "describe": host.describe() if host else None,
        "problem": why,
    }
