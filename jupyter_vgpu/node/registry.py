"""Which server a process belongs to: the slices registered with the arbiter, and the lookup.

A server is registered by the Hub (or, standalone, a trusted client over the socket) with
its slice and how its processes are known: its cgroup, its Kubernetes pod, its Slurm
job, or the process tree rooted at its process as the Hub started it (:mod:`jupyter_vgpu.host.procs`: a
PID that changed hands names an impostor, whose tree gets no slice). The arbiter asks
this for every kernel that connects and for every process the watchdog sees on a card;
never what a process says about itself.

:class:`Registry` is a part of :class:`.arbiter.Arbiter` (a mixin): it keeps
``servers`` and answers :meth:`~Registry.mapping`; a registration that changes a
server's slice tells its kernels, starts its card's MPS daemon where the slice asks for
one, and admits the kernels that connected before their server was known.
"""

from __future__ import annotations

import logging

from jupyter_vgpu.host import cgroups, peers, procs
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.units import format_bytes

from .books import Server

log = logging.getLogger("jupyter_vgpu.node")


class Registry:
    """The registered servers and the mapping of processes to them.

    Args:
        pod_of: maps a PID to the uid of its Kubernetes pod, or None.
        job_of: maps a PID to the id of its Slurm job, or None.

    Expects of the class it is mixed into: ``kernels``, ``conns``, ``unknown``,
    ``sessions``, ``mps_for`` and ``spawn``.
    """

    def __init__(self, pod_of, job_of):
        self.servers: dict[int | str, Server] = {}  # by Server.root
        self.pod_of = pod_of  # a PID's pod uid (its cgroup), for servers known by their pod
        self.job_of = job_of  # a PID's Slurm job id (its cgroup), for servers known by their job
        #: How a process is mapped to a server, tried in order: (name, function to a key or None).
        self.mappers = [
            ("cgroup", self._by_cgroup),
            ("pod", self._by_pod),
            ("job", self._by_job),
            ("tree", self._by_tree),
        ]

    def mapping(self, pid: int) -> tuple[int | str, str] | None:
        """``(key, how)``: the registered server ``pid`` belongs to, by its key in the
        books, and which of :attr:`mappers` found it (``cgroup``: the deepest registered
        server cgroup the process is in; ``pod``: its pod; ``job``: its Slurm job;
        ``tree``: the nearest registered server process it descends from); None when it
        belongs to none."""
        for how, mapper in self.mappers:
            key = mapper(pid)
            if key is not None:
                return key, how
        return None

    def root_of(self, pid: int) -> int | str | None:
        """The key of the registered server ``pid`` belongs to (:meth:`mapping`), or None."""
        found = self.mapping(pid)
        return found[0] if found is not None else None

    def server_of(self, pid: int) -> Server | None:
        """The registered server ``pid`` belongs to (:meth:`mapping`), or None."""
        root = self.root_of(pid)
        return self.servers.get(root) if root is not None else None

    def _by_cgroup(self, pid: int) -> str | None:
        held = [s for s in self.servers.values() if s.cgroup]
        if not held:
            return None
        memberships = cgroups.of(pid)
        best = None
        for s in held:
            deeper = best is None or len(s.cgroup) > len(best.cgroup)
            if deeper and cgroups.Cgroup(s.cgroup_hierarchy, s.cgroup).holds(memberships):
                best = s
        return best.root if best is not None else None

    def _by_pod(self, pid: int) -> str | None:
        if not any(s.pod_uid for s in self.servers.values()):
            return None
        uid = self.pod_of(pid)
        return f"pod:{uid}" if uid and f"pod:{uid}" in self.servers else None

    def _by_job(self, pid: int) -> str | None:
        if not any(s.job_id for s in self.servers.values()):
            return None
        job = self.job_of(pid)
        return f"job:{job}" if job and f"job:{job}" in self.servers else None

    def _by_tree(self, pid: int) -> int | str | None:
        """The nearest registered server process ``pid`` descends from, among those still
        the process the Hub started (its start time): a PID that changed hands since
        names an impostor, whose tree gets no slice."""
        roots = {s.pid: s for s in self.servers.values() if s.pid and not s.pod_uid and not s.job_id}
        if not roots:
            return None
        for p in peers.ancestors(pid):
            server = roots.get(p)
            if server is not None and self._still_started(server):
                return server.root
        return None

    @staticmethod
    def _still_started(server: Server) -> bool:
        """Whether process ``server.pid`` is still the one the Hub started: not ended, where
        the arbiter holds a pidfd of it (:attr:`.books.Server.process`), and of the same
        start time. The start time alone, in clock ticks (10 ms), took a process started
        on the PID within the tick of the server's end for the server: one run in about
        eight of the ``server-pid-reuse`` attack gave the attacker the victim's slice."""
        if server.start is None:
            return True
        if server.process is not None and server.process.ended():
            return False
        return procs.start_time(server.pid) == server.start

    def register(
        self,
        pid: int,
        user: str,
        name: str,
        slice_: Slice,
        pod_uid: str | None = None,
        cgroup: str | None = None,
        cgroup_hierarchy: str = cgroups.V2,
        job_id: str | None = None,
        start: int | None = None,
        uid: int | None = None,
    ) -> Server:
        """Give a server a slice (from the Hub or a trusted client): every process in its
        ``cgroup`` (a path in ``cgroup_hierarchy``) and below, or (``pid`` 0) every
        process of the pod ``pod_uid`` or of the Slurm job ``job_id``, or the process
        tree rooted at ``pid``.

        ``start`` is the start time of process ``pid`` as its spawner recorded it (clock
        ticks after boot; read now where not given, or kept from an earlier
        registration): a tree whose root is no longer that process belongs to no server.
        ``uid`` is the account the server runs as (None: not checked): no process of
        another uid is admitted as its kernel."""
        root = Server(pid, user, name, slice_, pod_uid, job_id=job_id, cgroup=cgroup).root
        old = self.servers.get(root)
        if pid and start is None:
            start = old.start if old is not None and old.pid == pid else procs.start_time(pid)
        process = None  # that very process, by a pidfd: a PID handed on within one tick reads the same start
        if pid and start is not None:
            if old is not None and old.pid == pid and old.start == start:
                process = old.process  # the Hub registers again every few seconds: the first one seen holds
            else:
                process = procs.Identity.of(pid)
                if process is not None and process.start != start:
                    process.close()
                    process = None
                if process is None and (old is None or old.start != start):
                    log.warning(
                        "%s/%s: process %d is no longer the server's (it ended; the PID may name another "
                        "process now): no process gets its slice through it", user, name, pid,
                    )  # fmt: skip
        server = Server(
            pid, user, name, slice_, pod_uid, job_id=job_id, cgroup=cgroup, cgroup_hierarchy=cgroup_hierarchy,
            start=start, uid=uid, process=process,
        )  # fmt: skip
        self.servers[root] = server
        for kernel in self.kernels:
            if kernel.server.root == root:
                kernel.server = server
        if old is None or old.slice != slice_:
            log.info("registered %s: %s, %s budget", server.key, root, format_bytes(slice_.memory_limit))
            for conn in self.conns.values():
                if conn.kernel is not None and conn.kernel.server is server:
                    self.spawn(self.sessions.send(conn, {"type": "slice", "slice": slice_.to_dict()}))
        self.mps_for(slice_)
        if old is not None and old.slice != slice_:
            self.mps_for(old.slice, start=False)  # the card it left, or whose ceiling it set
        for kpid, (conn, kernel_id) in list(self.unknown.items()):
            if self.root_of(kpid) == root:  # a kernel that came before its server did
                del self.unknown[kpid]
                self.spawn(self.sessions.admit(conn, server, kernel_id))
        return server

    def unregister(self, pid: int) -> None:
        """Forget the servers registered by process ``pid`` (not those known by their pod)."""
        for key in [k for k, s in self.servers.items() if s.pid == pid and not s.pod_uid]:
            gone = self.servers.pop(key)
            self.mps_for(gone.slice, start=False)  # its card's ceiling, without it
