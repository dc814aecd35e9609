"""The node arbiter: owns the host's cards and makes room for whoever runs a cell.

Kernels connect to its Unix socket (:mod:`.protocol`); the arbiter knows each by its
peer credentials and the registered server whose cgroup it is in (:mod:`.cgroups`; a
pod's on Kubernetes), or else whose process tree it descends from (:mod:`.peers`),
never by what it says. Before a kernel runs code it asks for room; the arbiter pauses
or suspends idle kernels on that card (:func:`.books.victims`), waiting for each one's
acknowledgement and for the memory to show up free, and grants the request, or queues
it with a message the user sees until room appears or the timeout passes. In the
background, while no kernel on a card runs code, it pauses kernels idle longer than
``idle_seconds`` if the card is above its watermark, and suspends kernels idle longer
than ``suspend_after``.

Host memory and disk are tiers of the node (:mod:`.tiers`): the host bytes of every
paused kernel count against ``host_memory_limit``, and the coldest paused kernels move
to the disk tier (:mod:`.disk`) before it is reached and before a pause would pass it.

A restart loses nothing: kernels reconnect on their own and say in their hello where
their memory is; slices come from the Hub (or, registered over the socket, from the
:mod:`.journal`); the driver says which processes are still checkpointed. One arbiter
serves a socket at a time (:mod:`.handoff`). Every wait of a cell is told to it as it
goes (``wait`` messages with what is being done and why).

All of it runs on one asyncio loop; NVML readings, the driver's checkpoint calls and
the disk tier's file work run in a thread pool so the loop never waits on them.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from jupyter_vgpu import failpoints
from jupyter_vgpu.slice import Slice, SliceError
from jupyter_vgpu.units import format_bytes

from . import (
    allowlist,
    books,
    cards,
    cgroups,
    disk,
    handoff,
    mps,
    namespaces,
    peers,
    procs,
    protocol,
    safe_dirs,
    slurm,
    tiers,
)
from .books import ACTIVE, IDLE, PAUSED, SUSPENDED, TIERS, Kernel, Reason, Server
from .cards import Reading
from .journal import Journal
from .metrics import Metrics
from .watchdog import Watchdog, owners

log = logging.getLogger("jupyter_vgpu.node")
T = TypeVar("T")


def _descendants(pid: int, uid: int) -> list[int]:
    """Every process of user ``uid`` descending from ``pid`` (from ``/proc``): the processes
    a kernel may have been suspended with, when the arbiter that suspended it is not this
    one. Another user's process below it (a setuid program) is never among them."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    return [p for p in pids if p != pid and pid in peers.ancestors(p) and procs.uid_of(p) == uid]


class ProcessChanged(RuntimeError):
    """A process the arbiter was about to act on has ended, or its PID names another
    process now; nothing was done."""


def _checked(identities: list[procs.Identity]) -> list[int]:
    """The PIDs of ``identities``, once each is checked to be still the process it was
    (:meth:`.procs.Identity.current`): the driver's checkpoint calls take PIDs, and a PID
    that changed hands names someone else. Called just before the call, on its thread.

    Raises:
        ProcessChanged: one of them has ended or changed hands.
    """
    changed = [i.pid for i in identities if i is None or not i.current()]
    if changed:
        raise ProcessChanged(f"process {', '.join(map(str, changed))} has ended or is not the one it was")
    return [i.pid for i in identities]


def _disk_error(message: str) -> bool:
    """True when a kernel's refusal to spill names an error of the file system (``OSError``
    and its kinds, ``SpillError``), not of the kernel (suspended, not paused)."""
    name = message.split(":", 1)[0].strip()
    kind = getattr(builtins, name, None)
    return name == "SpillError" or (isinstance(kind, type) and issubclass(kind, OSError))


class _Conn:
    """One connected client: the process that connected (:class:`.procs.Identity`, taken
    as it connected) and what it said.

    Writes never wait on the client for long: a client that stops reading is hung up on
    once :data:`SEND_TIMEOUT` passes or :data:`SEND_BUFFER` bytes wait for it, so that no
    client can hold up the arbiter's loop. Reading is paced (:data:`MESSAGES_PER_SECOND`,
    :data:`MESSAGE_BURST`): a client sending faster waits for its own next turn.
    """

    def __init__(self, reader, writer, pid: int, uid: int, trusted: bool, identity: procs.Identity | None):
        self.reader, self.writer = reader, writer
        self.pid, self.uid, self.trusted = pid, uid, trusted
        self.identity = identity
        self.kernel: Kernel | None = None
        self.hello: dict | None = None  # its hello, with the figures of its latest state
        self.pending: dict[int, asyncio.Future] = {}
        self.next_id = 1
        self.node_sent: tuple | None = None  # the node figures it was last told
        self.room_task: asyncio.Task | None = None  # its requests for room, one at a time
        self.room_next: tuple[int, str] | None = None  # (id, purpose) of the one waiting its turn
        self._tokens = float(MESSAGE_BURST)
        self._filled = time.monotonic()

    async def send(self, msg: dict) -> None:
        """Send ``msg``; the client is hung up on (ConnectionError) when it does not read."""
        self.writer.write(protocol.encode(msg))
        transport = self.writer.transport
        if transport is not None and transport.get_write_buffer_size() > SEND_BUFFER:
            self.writer.close()
            raise ConnectionError("the client does not read what it is sent")
        try:
            await asyncio.wait_for(self.writer.drain(), SEND_TIMEOUT)
        except TimeoutError:
            self.writer.close()
            raise ConnectionError("the client does not read what it is sent") from None

    async def paced(self) -> None:
        """Wait, if need be, until this client may send its next message."""
        now = time.monotonic()
        self._tokens = min(MESSAGE_BURST, self._tokens + (now - self._filled) * MESSAGES_PER_SECOND)
        self._filled = now
        if self._tokens < 1:
            await asyncio.sleep((1 - self._tokens) / MESSAGES_PER_SECOND)
            self._tokens, self._filled = 1.0, time.monotonic()
        self._tokens -= 1

    async def ask(self, msg: dict, timeout: float, sent=None) -> dict:
        """Send a request and wait for its reply (``{"ok": False}`` on timeout or hang-up,
        with ``"timeout": True`` for a timeout); ``sent()`` is called once it is sent (a
        failpoint)."""
        rid = self.next_id
        self.next_id += 1
        future = asyncio.get_running_loop().create_future()
        self.pending[rid] = future
        try:
            await self.send({**msg, "id": rid})
            if sent is not None:
                sent()
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            return {"ok": False, "timeout": True, "message": f"no answer within {timeout:.0f} s"}
        except ConnectionError:
            return {"ok": False, "message": "the kernel hung up"}
        finally:
            self.pending.pop(rid, None)


#: Seconds between two looks at the MPS daemons this arbiter started.
MPS_WATCH_SECONDS = 10.0
#: Seconds between two sweeps of the disk tier for directories of kernels that ended.
SWEEP_SECONDS = 5.0
#: Seconds the disk tier is left alone after a spill failed (a full or failing disk).
DISK_BACKOFF_SECONDS = 30.0
#: Seconds a client may take to read what it is sent, and bytes that may wait for it,
#: before it is hung up on.
SEND_TIMEOUT, SEND_BUFFER = 10.0, 4 * 2**20
#: How fast one client may send messages (per second, and in a burst): faster, its own
#: reading waits; the others' does not.
MESSAGES_PER_SECOND, MESSAGE_BURST = 200.0, 2000
#: Seconds a kernel that let a request go unanswered is not asked again (its memory stays
#: where it is meanwhile, as any kernel that cannot be paused), unless it answers sooner.
UNRESPONSIVE_SECONDS = 600.0
#: Seconds a kernel's refusal (to pause, suspend, spill or trim) stands, unless its state
#: changes sooner: asking again would get the same answer.
REFUSAL_SECONDS = 60.0
#: Bytes past its budget a kernel's host and disk figures may reach (chunk headers,
#: checksums) before the books stop believing them.
FIGURE_SLACK = 64 * 2**20


async def said_while(
    work: Awaitable[T], tell: Callable[[str], Awaitable[None]], what: str, every: float = 1.0
) -> T:
    """Await ``work`` and return its result, telling ``what`` at once and then every
    ``every`` seconds until it is done, with the seconds so far ("what (3 s)").

    Raises:
        Exception: whatever ``work`` raised.
    """
    task = asyncio.ensure_future(work)
    t0 = time.monotonic()
    try:
        await tell(what)
        while True:
            done, _ = await asyncio.wait({task}, timeout=every)
            if done:
                return task.result()
            await tell(f"{what} ({time.monotonic() - t0:.0f} s)")
    except asyncio.CancelledError:
        task.cancel()  # as if ``work`` had been awaited directly
        raise


class Arbiter:
    """The books and decisions of one host.

    Args:
        config: the :class:`~.app.ArbiterApp` (its settings: ``suspend_after``,
            ``watermark``, ``queue_timeout``, ``poll_seconds``, ``pause_timeout``).
        checkpoint: the module suspending and restoring processes
            (:mod:`.checkpoint`), or None where the driver lacks it.
        pod_of: maps a PID to the uid of its Kubernetes pod, or None
            (:func:`.namespaces.pod_uid`, which reads its cgroup).
        job_of: maps a PID to the id of its Slurm job, or None (:func:`.slurm.job_id`,
            which reads its cgroup).
    """

    def __init__(self, config, checkpoint=None, pod_of=namespaces.pod_uid, job_of=slurm.job_id):
        self.config = config
        self.checkpoint = checkpoint
        self.pod_of = pod_of  # a PID's pod uid (its cgroup), for servers known by their pod
        self.job_of = job_of  # a PID's Slurm job id (its cgroup), for servers known by their job
        self.servers: dict[int | str, Server] = {}  # by Server.root
        self.conns: dict[int, _Conn] = {}  # kernel pid -> its connection
        self.unknown: dict[int, tuple[_Conn, str]] = {}  # pid -> (connection, kernel id): no server yet
        self.metrics = Metrics()
        self.decisions: collections.deque = collections.deque(maxlen=200)
        self._locks: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self._prefetched: dict[str, float] = {}  # user -> monotonic seconds of their last prefetch
        self._changed: asyncio.Condition | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: list[asyncio.Task] = []
        self._inflight: set[asyncio.Task] = set()
        self.mps = mps.MPSDaemons(getattr(config, "socket_path", "") or "/run/jupyter-vgpu/arbiter.sock")
        self._mps_watched = 0.0  # monotonic seconds of the last look at the daemons
        self._mps_asked: set[str] = set()  # GPUs whose daemon was started (or found missing)
        self.refresh_servers = None  # async callable re-reading registrations (the Hub link)
        self.watchdog = Watchdog(
            config.over_budget,
            config.grace_seconds,
            unowned_policy=getattr(config, "unowned_policy", "report"),
        )
        # never ended, never reported: this arbiter and whoever started it (the Hub)
        self.protected = set(peers.ancestors(os.getpid()))
        self.unowned: dict[int, dict] = {}  # pid -> what is known of an unowned GPU process now
        self._managed: set[str] | None = None  # the managed cards besides the slices' (read once)
        self._card_of: dict[int, str] = {}  # pid -> the managed card it holds most on (last look)
        self._unowned_cards: set[str] = set()  # cards with unowned processes at the last look
        # How a process is mapped to a server, tried in order: (name, function to a key or None).
        self.mappers = [
            ("cgroup", self._by_cgroup),
            ("pod", self._by_pod),
            ("job", self._by_job),
            ("tree", self._by_tree),
        ]
        self._refreshing: asyncio.Future | None = None
        self.journal: Journal | None = None  # registrations over the socket (standalone)
        self._lock_fd: int | None = None
        self.disk_root: str = getattr(config, "disk_dir", "") or ""
        self.disk: disk.DiskTier | None = None  # the disk tier, once its root is made (start)
        self.disk_problem: str | None = None  # why the disk tier failed last, while it is left alone
        self._disk_retry = 0.0  # monotonic seconds after which the disk tier is tried again
        self._swept = 0.0
        self._spilling: asyncio.Task | None = None
        self._spills: dict[int, asyncio.Future] = {}  # kernel pid -> its spill in progress
        self.started = time.monotonic()
        self.per_uid: collections.Counter[int] = collections.Counter()  # open connections by uid
        self._seen: dict[int, procs.Identity] = {}  # processes on the managed cards at the last look

    # -- the books -------------------------------------------------------------------

    @property
    def kernels(self) -> list[Kernel]:
        return [c.kernel for c in self.conns.values() if c.kernel is not None]

    def on_card(self, uuid: str) -> list[Kernel]:
        return [k for k in self.kernels if k.slice.gpu_uuid == uuid]

    def mapping(self, pid: int) -> tuple[int | str, str] | None:
        """``(key, how)``: the registered server ``pid`` belongs to, by its key in the
        books, and which of :attr:`mappers` found it (``cgroup``: the deepest registered
        server cgroup the process is in; ``pod``: its pod; ``tree``: the nearest
        registered server process it descends from); None when it belongs to none."""
        for how, mapper in self.mappers:
            key = mapper(pid)
            if key is not None:
                return key, how
        return None

    def root_of(self, pid: int) -> int | str | None:
        """The key of the registered server ``pid`` belongs to (:meth:`mapping`), or None."""
        found = self.mapping(pid)
        return found[0] if found is not None else None

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
            if server is not None and (server.start is None or procs.start_time(p) == server.start):
                return server.root
        return None

    def server_of(self, pid: int) -> Server | None:
        root = self.root_of(pid)
        return self.servers.get(root) if root is not None else None

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
        if (
            pid
            and start is not None
            and (old is None or old.start != start)
            and procs.start_time(pid) != start
        ):
            log.warning(
                "%s/%s: process %d is no longer the server's (it ended; the PID may name another "
                "process now): no process gets its slice through it", user, name, pid,
            )  # fmt: skip
        server = Server(
            pid, user, name, slice_, pod_uid, job_id=job_id, cgroup=cgroup, cgroup_hierarchy=cgroup_hierarchy,
            start=start, uid=uid,
        )  # fmt: skip
        self.servers[root] = server
        for kernel in self.kernels:
            if kernel.server.root == root:
                kernel.server = server
        if old is None or old.slice != slice_:
            log.info("registered %s: %s, %s budget", server.key, root, format_bytes(slice_.memory_limit))
            for conn in self.conns.values():
                if conn.kernel is not None and conn.kernel.server is server:
                    self._spawn(self._send(conn, {"type": "slice", "slice": slice_.to_dict()}))
        if (
            slice_.isolation == "mps"
            and not slice_.simulated
            and getattr(self.config, "mps_daemons", True)
            and slice_.gpu_uuid not in self._mps_asked
        ):
            self._mps_asked.add(slice_.gpu_uuid)
            self._spawn(self._start_mps(slice_.gpu_uuid))
        for kpid, (conn, kernel_id) in list(self.unknown.items()):
            if self.root_of(kpid) == root:  # a kernel that came before its server did
                del self.unknown[kpid]
                self._spawn(self._admit(conn, server, kernel_id))
        return server

    async def _start_mps(self, uuid: str) -> None:
        """Start (or find) the MPS control daemon of GPU ``uuid``; the outcome is a decision."""
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.mps.ensure, uuid)
            self._decide("mps daemon", gpu=uuid, message="running")
        except mps.MPSUnavailable as e:
            self._decide("mps unavailable", gpu=uuid, message=str(e))

    async def _watch_mps(self, now: float) -> None:
        """Restart every daemon this arbiter started that no longer answers; asks at most
        every :data:`MPS_WATCH_SECONDS` (each question starts the control program)."""
        if not self.mps.started or now - self._mps_watched < MPS_WATCH_SECONDS:
            return
        self._mps_watched = now
        loop = asyncio.get_running_loop()
        for uuid in sorted(self.mps.started):
            if not await loop.run_in_executor(None, self.mps.running, uuid):
                self.mps.started.discard(uuid)
                self._decide("mps daemon gone", gpu=uuid, message="restarting it")
                await self._start_mps(uuid)

    def _simulated_total(self, uuid: str) -> int | None:
        for server in self.servers.values():
            if server.slice.gpu_uuid == uuid:
                return server.slice.gpu_memory if server.slice.simulated else None
        return None

    async def read(self, uuid: str) -> Reading:
        """The card now; on a real card every kernel's ``resident`` is updated from NVML."""
        kernels = self.on_card(uuid)
        reported = {k.pid: k.resident for k in kernels}
        total = self._simulated_total(uuid)
        reading = await asyncio.get_running_loop().run_in_executor(None, cards.read, uuid, total, reported)
        if total is None:
            for k in kernels:
                k.resident = reading.processes.get(k.pid, 0)
        return reading

    def snapshot(self) -> dict:
        """The arbiter's view: servers, kernels and recent decisions (``books`` requests)."""
        now = time.monotonic()
        return {
            "servers": [
                {
                    "pid": s.pid,
                    "key": s.key,
                    "pod_uid": s.pod_uid,
                    "job_id": s.job_id,
                    "cgroup": str(cgroups.Cgroup(s.cgroup_hierarchy, s.cgroup)) if s.cgroup else None,
                    "user": s.user,
                    "server": s.name,
                    "gpu_uuid": s.slice.gpu_uuid,
                    "memory_limit": s.slice.memory_limit,
                    "memory_request": s.slice.memory_request,
                    "priority": s.slice.priority,
                }
                for s in self.servers.values()
            ],
            "kernels": [
                {
                    "pid": k.pid,
                    "container_pid": namespaces.container_pid(k.pid) or k.pid,
                    "server": k.server.key,
                    "kernel_id": k.kernel_id,
                    "state": k.state,
                    "idle_seconds": k.idle_for(now),
                    "resident": k.resident,
                    "paused_bytes": k.paused_bytes,
                    "host_bytes": k.host_bytes,
                    "disk_bytes": k.disk_bytes,
                    "tier": k.tier,
                    "budget": k.budget,
                    "gpu_uuid": k.slice.gpu_uuid,
                    # a call of the driver's checkpoint about it in progress: which, since when
                    "driver_call": {"call": k.driver_call[0], "since": k.driver_call[1]}
                    if k.driver_call
                    else None,
                }
                for k in self.kernels
            ],
            "unknown": sorted(self.unknown),
            "node": self.node_figures(),
            "decisions": list(self.decisions),
            "unowned": sorted(self.unowned.values(), key=lambda u: u["pid"]),
        }

    # -- host memory and disk ----------------------------------------------------------

    def host_budget(self) -> tiers.HostBudget:
        """The node's host budget for paused kernels, from the settings and ``/proc/meminfo``."""
        total = tiers.meminfo().get("MemTotal", 0)
        limit = getattr(self.config, "host_memory_limit", None)
        if limit is None:
            limit = int(total * getattr(self.config, "host_memory_fraction", 0.5))
        reserve = getattr(self.config, "host_reserve", None)
        if reserve is None:
            reserve = max(2**30, total // 20)
        spill_at = int(limit * getattr(self.config, "host_spill_fraction", 0.8))
        return tiers.HostBudget(limit, spill_at, reserve)

    def node_figures(self) -> dict:
        """The node's tiers now: ``host_used`` (host bytes of paused and suspended kernels),
        ``host_limit``, ``host_available`` (``MemAvailable``), ``disk_used`` (bytes in the
        disk tier), ``disk_free`` (free bytes on its file system, or None), ``disk_dir``,
        ``disk_problem``, and how many kernels are in each tier."""
        kernels = self.kernels
        return {
            "host_used": tiers.host_used(kernels),
            "host_limit": self.host_budget().limit,
            "host_available": tiers.meminfo().get("MemAvailable", 0),
            "disk_used": tiers.disk_used(kernels),
            "disk_free": self.disk.free_bytes() if self.disk is not None else None,
            "disk_dir": self.disk_root or None,
            "disk_problem": self.disk_problem,
            "tiers": {t: sum(1 for k in kernels if k.tier == t) for t in TIERS},
        }

    def _disk_dir_of(self, conn: _Conn) -> str | None:
        """The disk tier directory of the kernel on ``conn`` (made at its first spill)."""
        if self.disk is None or conn.identity is None:
            return None
        return self.disk.kernel_dir(conn.uid, conn.pid, conn.identity.start)

    def _disk_usable(self, need: int) -> str | None:
        """Why ``need`` more bytes cannot go to the disk tier now (None: they can)."""
        if self.disk is None:
            if self.disk_root:
                return self.disk_problem or f"the disk tier {self.disk_root} is not in use"
            return "there is no disk tier (ArbiterApp.disk_dir is empty)"
        if time.monotonic() < self._disk_retry:
            return self.disk_problem or "the disk tier failed a moment ago"
        limit = getattr(self.config, "disk_limit", None)
        used = tiers.disk_used(self.kernels)
        if limit is not None and used + need > limit:
            return f"the disk tier holds {format_bytes(used)} of its {format_bytes(limit)} limit"
        free = self.disk.free_bytes()
        keep = getattr(self.config, "disk_reserve", 2**30) or 0
        if free is not None and free - need < keep:
            return (
                f"the disk tier's file system has {format_bytes(free)} free, and "
                f"{format_bytes(keep)} must stay free (ArbiterApp.disk_reserve)"
            )
        return None

    async def spill(self, kernel: Kernel, tell=None) -> bool:
        """Move a paused kernel's host memory to the disk tier; True when it did. A refusal
        (a full or failing disk) is a decision and leaves the data where it was. Callers
        at the same time share one request to the kernel."""
        running = self._spills.get(kernel.pid)
        if running is None or running.done():
            running = self._spills[kernel.pid] = asyncio.ensure_future(self._spill(kernel, tell))
            running.add_done_callback(lambda _, pid=kernel.pid: self._spills.pop(pid, None))
        return await asyncio.shield(running)

    async def _spill(self, kernel: Kernel, tell=None) -> bool:
        conn = self.conns.get(kernel.pid)
        if conn is None or conn.kernel is not kernel or kernel.state != PAUSED or kernel.host_bytes <= 0:
            return False
        why = self._disk_usable(kernel.host_bytes)
        if why is None and not kernel.disk_dir:
            why = "the kernel has no directory in the disk tier"
        if why is not None:
            self._decide("spill skipped", server=kernel.server.key, pid=kernel.pid, message=why)
            return False
        loop = asyncio.get_running_loop()
        try:  # the user's directory, theirs and private
            await loop.run_in_executor(None, self.disk.user_dir, kernel.uid)
        except safe_dirs.UnsafePath as e:  # that user's directory alone: their spills wait
            kernel.refused["spill"] = time.monotonic()
            self._decide("spill skipped", server=kernel.server.key, pid=kernel.pid, message=str(e))
            return False
        except OSError as e:
            self.disk_problem = f"the disk tier's directory cannot be made: {e}"
            self._disk_retry = time.monotonic() + DISK_BACKOFF_SECONDS
            self._decide("spill skipped", server=kernel.server.key, pid=kernel.pid, message=self.disk_problem)
            return False
        if tell is not None:
            await tell(
                f"moving {kernel.server.key}'s paused memory ({format_bytes(kernel.host_bytes)}) to disk"
            )
        t0 = time.monotonic()
        held = kernel.host_bytes
        answer = await conn.ask(
            {"type": "spill", "dir": kernel.disk_dir},
            self.config.pause_timeout,
            sent=lambda: failpoints.hit("arbiter.spill"),
        )
        if not answer.get("ok") and self.conns.get(kernel.pid) is not conn:
            self._decide(
                "spill cut short", server=kernel.server.key, pid=kernel.pid, message="the kernel left"
            )
            return False
        self._heard(kernel, "spill", answer)
        if not answer.get("ok"):
            self.metrics.spill_failures.inc()
            message = answer.get("message", "")
            # a full or failing disk (the arbiter's own write fails too) leaves the disk tier
            # alone a while; a kernel's own trouble, or its word alone, stops only its spills
            broken = await loop.run_in_executor(None, self.disk.probe) if _disk_error(message) else None
            if broken is not None:
                self.disk_problem = (
                    f"spilling {kernel.server.key} failed: {message} (the disk tier: {broken})"
                )
                self._disk_retry = time.monotonic() + DISK_BACKOFF_SECONDS
            self._decide("spill failed", server=kernel.server.key, pid=kernel.pid, message=message)
            return False
        kernel.disk_measured = await loop.run_in_executor(None, self._disk_size, kernel)
        self._apply(kernel, {"disk_bytes": kernel.disk_bytes})
        if kernel.host_bytes >= held:  # it said it spilled, and holds as much as before
            kernel.refused["spill"] = time.monotonic()
            why = "the kernel said it moved its memory to disk, yet holds as much host memory as before"
            self._decide("spill failed", server=kernel.server.key, pid=kernel.pid, message=why)
            return False
        self.disk_problem = None
        self.metrics.spills.inc()
        self._decide(
            "spill", server=kernel.server.key, pid=kernel.pid, seconds=round(time.monotonic() - t0, 3),
            message=f"{format_bytes(held)} of host memory to the disk tier",
        )  # fmt: skip
        return True

    async def trim(self, kernel: Kernel) -> int:
        """Ask an idle kernel to let go of the pinned slabs it keeps warm for its next pause;
        the bytes it gave back (0: refused, or it held none)."""
        conn = self.conns.get(kernel.pid)
        if conn is None or conn.kernel is not kernel or kernel.state != IDLE or kernel.host_bytes <= 0:
            return 0
        answer = await conn.ask({"type": "trim"}, self.config.pause_timeout)
        self._heard(kernel, "trim", answer)
        released = answer.get("released")  # its figures came first, in a state message
        if not answer.get("ok") or not isinstance(released, int) or released <= 0:
            why = answer.get("message", "")
            self._decide("trim refused", server=kernel.server.key, pid=kernel.pid, message=why)
            return 0
        self.metrics.trimmed.inc(released)
        self._decide(
            "trim", server=kernel.server.key, pid=kernel.pid,
            message=f"{format_bytes(released)} of warm pinned host memory let go (its next pause pins again)",
        )  # fmt: skip
        return released

    async def _host_room(self, victim: Kernel, need: int, tell=None) -> str | None:
        """Trim idle kernels' warm slabs (each asked once), then spill colder paused kernels,
        until ``need`` bytes of ``victim`` fit in host memory; None when they fit, else why
        not. A pause that would eat into the host's reserve
        is never made (the OOM killer would take whole kernels); one that would pass the
        node's budget only when nothing colder is left to spill and the disk tier can take
        the victim next (a kernel larger than the budget on its own).

        What a kernel that declined to spill holds is its own (:func:`.books.cooperative`):
        it counts against no one else's pause, and it is not asked again before
        :data:`REFUSAL_SECONDS`; the host's reserve (``MemAvailable``, measured) still
        counts everyone's memory."""
        asked: list[Kernel] = []  # to trim: one that gave nothing back is not asked again
        tried: list[Kernel] = []  # to spill: each at most once here
        while True:
            now = time.monotonic()
            counted = books.cooperative(self.kernels, but=victim)
            budget = self.host_budget()
            available = tiers.meminfo().get("MemAvailable", 0)
            over_budget, over_reserve = tiers.host_room(counted, budget, need, available)
            if not over_budget and not over_reserve:
                return None
            held = format_bytes(tiers.host_used(counted))
            why = (
                f"host memory for paused kernels is full ({held} of {format_bytes(budget.limit)} held, "
                f"{format_bytes(available)} available)"
            )
            warm = [
                k
                for k in tiers.trimmable(counted, now, exclude=(victim, *asked))
                if not k.declined("trim", now, REFUSAL_SECONDS)
            ]
            if warm:
                asked.append(warm[0])
                if await self.trim(warm[0]):
                    continue  # losing no data comes before moving any to disk
            candidates = [
                k
                for k in tiers.spillable(counted, now, exclude=(victim, *tried))
                if not k.declined("spill", now, REFUSAL_SECONDS)
            ]
            if not candidates:
                disk_why = self._disk_usable(need)
                if not over_reserve and disk_why is None:
                    note = f"{why}: nothing else to move to disk; it goes there next"
                    self._decide(
                        "past the host budget", server=victim.server.key, pid=victim.pid, message=note
                    )
                    return None
                disk_why = disk_why or "no other paused kernel holds host memory to move there"
                return f"{why}, and the disk tier takes nothing now: {disk_why}"
            disk_why = self._disk_usable(candidates[0].host_bytes)
            if disk_why is not None:
                return f"{why}, and the disk tier takes nothing now: {disk_why}"
            tried.append(candidates[0])
            await self.spill(candidates[0], tell)  # whatever came of it, the next look says

    async def _spill_coldest(self) -> None:
        """Trim idle kernels' warm slabs, then spill the coldest paused kernels, while the
        node is over its spill mark (kernels that declined either are left out: their
        memory is their own, :func:`.books.cooperative`)."""
        now = time.monotonic()
        counted = books.cooperative(self.kernels)
        for kernel in tiers.to_trim(counted, self.host_budget(), tiers.meminfo().get("MemAvailable", 0), now):
            if not kernel.declined("trim", now, REFUSAL_SECONDS):
                await self.trim(kernel)
        tried: list[Kernel] = []
        while True:
            now = time.monotonic()
            counted = books.cooperative(self.kernels)
            todo = [
                k
                for k in tiers.to_spill(
                    counted, self.host_budget(), tiers.meminfo().get("MemAvailable", 0), now
                )
                if k not in tried and not k.declined("spill", now, REFUSAL_SECONDS)
            ]
            if not todo or self._disk_usable(todo[0].host_bytes) is not None:
                return
            tried.append(todo[0])
            await self.spill(todo[0])

    async def _tiers(self, now: float) -> None:
        """The host budget's background step: spill what is over the mark, tell the kernels
        the node's figures, publish the gauges, sweep the disk tier of ended kernels."""
        if self._spilling is None or self._spilling.done():
            self._spilling = asyncio.ensure_future(self._spill_coldest())
        figures = self.node_figures()
        m = self.metrics
        m.host_bytes.set(figures["host_used"])
        m.host_limit.set(figures["host_limit"])
        m.disk_bytes.set(figures["disk_used"])
        for tier, n in figures["tiers"].items():
            m.kernels.labels(tier=tier).set(n)
        told = (figures["host_used"] >> 20, figures["host_limit"] >> 20, figures["disk_used"] >> 20)
        for conn in list(self.conns.values()):
            if conn.node_sent != told:
                conn.node_sent = told
                msg = {k: figures[k] for k in ("host_used", "host_limit", "disk_used")}
                await self._send(conn, {"type": "node", **msg})
        if self.disk is not None and now - self._swept >= SWEEP_SECONDS:
            self._swept = now
            loop = asyncio.get_running_loop()
            for path in await loop.run_in_executor(None, self.disk.sweep):
                self._decide("disk tier freed", message=f"{path}: its kernel has ended")
            for kernel in [
                k for k in self.kernels if k.disk_bytes > 0
            ]:  # what they say, against what is there
                kernel.disk_measured = await loop.run_in_executor(None, self._disk_size, kernel)
                self._apply(kernel, {"disk_bytes": kernel.disk_bytes})

    def _disk_size(self, kernel: Kernel) -> int | None:
        """Bytes in ``kernel``'s directory of the disk tier now (None: no disk tier)."""
        if self.disk is None or kernel.identity is None:
            return None
        return self.disk.size(kernel.uid, kernel.pid, kernel.identity.start)

    def spawn_every(self, seconds: float, step) -> None:
        """Run the coroutine function ``step`` now and every ``seconds`` until :meth:`stop`
        (its failures are logged, the next one still runs)."""

        async def loop():
            while True:
                try:
                    await step()
                except Exception:
                    log.exception("periodic %s failed", getattr(step, "__qualname__", step))
                await asyncio.sleep(seconds)

        self._tasks.append(asyncio.ensure_future(loop()))

    def _spawn(self, coro) -> None:
        """Run ``coro`` as a task the arbiter keeps a reference to until it ends."""
        task = asyncio.ensure_future(coro)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    def _decide(self, what: str, **fields) -> None:
        entry = {"time": time.time(), "what": what, **fields}
        self.decisions.append(entry)
        log.info("%s %s", what, " ".join(f"{k}={v}" for k, v in fields.items()))

    async def _notify(self) -> None:
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()

    # -- the socket ------------------------------------------------------------------

    async def start(self, path: str | Path) -> None:
        """Listen on ``path``, once the arbiter serving it before has handed over
        (:mod:`.handoff`); slices registered over the socket before a restart come back
        from the journal.

        The socket's directory is made (0755) or checked through :mod:`.safe_dirs`: no
        link, no component another user owns or may write, so that no one but this
        arbiter's user (and root) can put a file there, the lock file and the journal
        included. The disk tier's root is made the same way (:class:`.disk.DiskTier`);
        where it is not safe, the disk tier stays off and the log and the node's figures
        say why.

        Raises:
            safe_dirs.UnsafePath: the socket's directory is not safe to use.
            OSError: it cannot be made, or the arbiter before does not let go.
        """
        path = Path(path)
        loop = asyncio.get_running_loop()
        directory = await loop.run_in_executor(None, safe_dirs.open_dir, path.parent, True, 0o755)
        try:
            self._lock_fd = await loop.run_in_executor(None, handoff.take, directory)
        finally:
            os.close(directory)
        if self.config.registrars != "none":
            self.journal = Journal(path.parent / "registrations.json")
            for pid, user, name, slice_, start, uid in self.journal.load():
                self.register(pid, user, name, slice_, start=start, uid=uid)
        if self.disk_root:
            try:
                self.disk = await loop.run_in_executor(None, disk.DiskTier, self.disk_root)
            except OSError as e:
                self.disk_problem = f"the disk tier is off: {e}"
                log.error("%s", self.disk_problem)
            else:
                for gone in await loop.run_in_executor(None, self.disk.sweep):
                    self._decide("disk tier freed", message=f"{gone}: its kernel has ended")
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._changed = asyncio.Condition()
        self._server = await asyncio.start_unix_server(self._serve, str(path), limit=protocol.MAX_LINE)
        os.chmod(path, 0o666)  # anyone may connect; who they are comes from the kernel
        self._tasks.append(asyncio.ensure_future(self._background()))
        log.info("listening on %s", path)

    async def stop(self) -> None:
        """Stop listening and hang up on every client (kernels reconnect to the next arbiter)."""
        for task in [*self._tasks, *self._inflight]:
            task.cancel()
        if self._server is not None:
            self._server.close()
        for conn in [*self.conns.values(), *(c for c, _ in self.unknown.values())]:
            conn.writer.close()
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the next arbiter may take over
            self._lock_fd = None
        if self.disk is not None:
            self.disk.close()
            self.disk = None

    async def _send(self, conn: _Conn, msg: dict) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            await conn.send(msg)

    async def _serve(self, reader, writer) -> None:
        """One client, from its connection to its hang-up.

        Who it is comes from the Linux kernel, never from what it says: its peer
        credentials and its :class:`.procs.Identity` (a client whose process has ended
        since it connected, its PID perhaps another process's now, is turned away). A
        user may hold :attr:`ArbiterApp.max_connections_per_user` connections at once
        (root: any number); a client must say something within
        ``ArbiterApp.hello_timeout`` seconds of connecting, then may stay idle for as long
        as it likes."""
        try:
            pid, uid, identity = procs.Identity.of_peer(writer.get_extra_info("socket"))
        except OSError:
            writer.close()
            return
        conn = _Conn(reader, writer, pid, uid, trusted=uid in (0, os.geteuid()), identity=identity)
        cap = getattr(self.config, "max_connections_per_user", 128)
        why = None
        if identity is None:
            why = "the process that connected has ended (its PID may name another process now)"
        elif uid != 0 and self.per_uid[uid] >= cap:
            why = (
                f"uid {uid} holds {self.per_uid[uid]} connections to the arbiter already, its limit "
                "(ArbiterApp.max_connections_per_user)"
            )
            self.metrics.refused_connections.inc()
            log.warning("connection refused: %s", why)
        if why is not None:
            await self._send(conn, {"type": "error", "message": f"refused: {why}"})
            writer.close()
            if identity is not None:
                identity.close()
            return
        self.per_uid[uid] += 1
        first = True
        try:
            while True:
                try:
                    wait = getattr(self.config, "hello_timeout", 10.0) if first else None
                    line = await asyncio.wait_for(reader.readline(), wait)
                except TimeoutError:
                    await self._send(conn, {"type": "error", "message": "nothing said after connecting"})
                    return
                except (asyncio.LimitOverrunError, ValueError):
                    await self._send(conn, {"type": "error", "message": "line too long"})
                    return
                if not line:
                    return
                first = False
                await conn.paced()
                try:
                    msg = protocol.decode(line)
                except protocol.ProtocolError as e:
                    await self._send(conn, {"type": "error", "message": str(e)})
                    continue
                await self._dispatch(conn, msg)
        except ConnectionError:
            pass
        finally:
            self.per_uid[uid] -= 1
            if self.per_uid[uid] <= 0:
                del self.per_uid[uid]
            if conn.room_task is not None:
                conn.room_task.cancel()
            if self.unknown.get(conn.pid, (None,))[0] is conn:
                del self.unknown[conn.pid]
            if conn.kernel is not None and self.conns.get(conn.pid) is conn:
                del self.conns[conn.pid]
                self._decide("kernel left", server=conn.kernel.server.key, pid=conn.pid)
                if conn.kernel.disk_dir and self.disk is not None and not identity.current():
                    # it ended: its disk tier goes too
                    loop = asyncio.get_running_loop()
                    self._spawn(loop.run_in_executor(None, self.disk.remove, uid, pid, identity.start))
                await self._notify()
            for future in conn.pending.values():
                if not future.done():
                    future.set_result({"ok": False, "message": "the kernel hung up"})
            writer.close()
            identity.close()

    def _may_register(self, conn: _Conn) -> str | None:
        """Why ``conn`` may not name slices (None: it may)."""
        if self.config.registrars == "none":
            return "slices come from the Hub here; nobody registers them over the socket"
        return self._may_read(conn)

    def _may_read(self, conn: _Conn) -> str | None:
        """Why ``conn`` may not read the books, every user's figures (None: it may)."""
        if not conn.trusted:
            return "only the arbiter's own user (or root) may"
        if self.root_of(conn.pid) is not None:
            return "no process of a user's server may"
        return None

    async def _dispatch(self, conn: _Conn, msg: dict) -> None:
        kind = msg["type"]
        if kind in protocol.TRUSTED:
            why = self._may_read(conn) if kind in ("books", "refresh") else self._may_register(conn)
            if why:
                await self._send(conn, {"type": "error", "message": f"{kind} refused: {why}"})
                return
            await self._trusted(conn, msg)
        elif kind == "hello":
            await self._hello(conn, msg)
        elif conn.kernel is None and conn.hello is not None:
            if kind == "state":  # a kernel whose server is not known yet: kept for its admission
                conn.hello = {
                    **conn.hello,
                    **msg,
                    "type": "hello",
                    "idle_seconds": conn.hello.get("idle_seconds", 0),
                }
        elif conn.kernel is None:
            await self._send(conn, {"type": "error", "message": "say hello first"})
        elif kind == "state":
            self._state(conn.kernel, msg)
            await self._notify()
        elif kind == "room":
            if conn.room_next is not None:  # one waits for its turn already: this one replaces it
                why = "a newer request for room from this kernel replaced this one"
                await self._send(conn, {"type": "deny", "id": conn.room_next[0], "message": why})
            conn.room_next = (msg["id"], msg["for"])
            if conn.room_task is None or conn.room_task.done():
                conn.room_task = asyncio.ensure_future(self._rooms(conn))
        elif kind == "reply":
            future = conn.pending.get(msg["id"])
            if future is not None and not future.done():
                future.set_result(msg)

    async def _rooms(self, conn: _Conn) -> None:
        """A kernel's requests for room, one at a time (a kernel runs one message at a
        time; one asked while another is decided waits its turn, and at most one waits)."""
        while conn.room_next is not None:
            (rid, purpose), conn.room_next = conn.room_next, None
            if purpose == "prefetch":
                await self._prefetch(conn, rid)
            else:
                await self._room(conn, rid, purpose)

    async def _trusted(self, conn: _Conn, msg: dict) -> None:
        kind = msg["type"]
        if kind == "register":
            try:
                slice_ = Slice.from_dict(msg["slice"])
            except SliceError as e:
                await self._send(conn, {"type": "error", "message": f"register: {e}"})
                return
            try:
                where = cgroups.Cgroup.parse_name(msg["cgroup"]) if msg.get("cgroup") else None
            except ValueError as e:
                await self._send(conn, {"type": "error", "message": f"register: {e}"})
                return
            cgroup, hierarchy = (where.path, where.hierarchy) if where else (None, cgroups.V2)
            server = self.register(
                msg["pid"], msg["user"], msg["server"], slice_, cgroup=cgroup, cgroup_hierarchy=hierarchy,
                start=msg.get("start"), uid=msg.get("uid"),
            )  # fmt: skip
            if self.journal is not None:
                self.journal.add(msg["pid"], msg["user"], msg["server"], slice_, server.start, server.uid)
            await self._send(conn, {"type": "ok"})
        elif kind == "unregister":
            for key in [k for k, s in self.servers.items() if s.pid == msg["pid"] and not s.pod_uid]:
                del self.servers[key]
            if self.journal is not None:
                self.journal.remove(msg["pid"])
            await self._send(conn, {"type": "ok"})
        elif kind == "refresh":
            if self.refresh_servers is not None:
                await self.refresh_servers()
            await self._send(conn, {"type": "ok"})
        else:
            await self._send(conn, {"type": "ok", "books": self.snapshot()})

    async def refresh(self) -> None:
        """Read the registrations again (the Hub's slices); callers at the same time share
        one read (twenty kernels reconnecting after a restart make one request)."""
        if self.refresh_servers is None:
            return
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self.refresh_servers())
        await asyncio.shield(self._refreshing)

    async def _hello(self, conn: _Conn, msg: dict) -> None:
        """A kernel says who it is and, from version 2 on, where its memory is: a kernel
        that reconnects after a restart brings its state back into the books."""
        failpoints.hit("arbiter.hello")
        conn.hello = msg
        server = self.server_of(conn.pid)
        if server is None and self.refresh_servers is not None:
            await self.refresh()
            server = self.server_of(conn.pid)
        if server is None:
            self.unknown[conn.pid] = (conn, msg["kernel_id"])
            await self._send(conn, {"type": "welcome", "slice": None, "server": None, "disk_dir": None})
            return
        await self._admit(conn, server, msg["kernel_id"])

    def _inadmissible(self, conn: _Conn, server: Server) -> str | None:
        """Why the process on ``conn`` may not be ``server``'s kernel (None: it may): it
        must still be the process that connected (its PID was read to find its server),
        and of the server's account where the Hub names one."""
        if conn.identity is None or not conn.identity.current():
            return "the process that connected has ended (its PID may name another process now)"
        if server.uid is not None and conn.uid != server.uid:
            return f"this process runs as uid {conn.uid}, not as {server.key}'s account (uid {server.uid})"
        return None

    def _apply(self, kernel: Kernel, msg: dict) -> None:
        """Take the byte figures of a kernel's hello or state (those ``msg`` holds) into
        the books, never past what its slice allows nor past what the arbiter measured:
        paused bytes at most its budget, or what NVML showed it holding just before its
        pause (:attr:`.books.Kernel.measured`); host and disk bytes at most its budget
        plus :data:`FIGURE_SLACK`, disk bytes at most what its directory of the disk tier
        holds (:attr:`.books.Kernel.disk_measured`); a simulated card's resident bytes at
        most the card. A figure past its bound is logged once, and the bound is used."""
        budget = kernel.budget
        held = budget + FIGURE_SLACK
        bounds = {
            "paused_bytes": budget if kernel.measured is None else kernel.measured + FIGURE_SLACK,
            "host_bytes": held,
            "disk_bytes": held if kernel.disk_measured is None else min(held, kernel.disk_measured),
            "resident": kernel.slice.gpu_memory or budget,
        }
        for key, bound in bounds.items():
            if key not in msg or (key == "resident" and not kernel.slice.simulated):
                continue  # on a real card, resident bytes are NVML's
            value = msg[key]
            if value > bound and key != "disk_bytes" and not kernel.capped:
                kernel.capped = True
                self._decide(
                    "figure capped", server=kernel.server.key, pid=kernel.pid,
                    message=f"it says {key} {format_bytes(value)}; the books hold {format_bytes(bound)}",
                )  # fmt: skip
            setattr(kernel, key, min(value, bound))

    async def _admit(self, conn: _Conn, server: Server, kernel_id: str) -> None:
        why = self._inadmissible(conn, server)
        if why is not None:
            self.metrics.refused_peers.inc()
            self._decide("kernel refused", server=server.key, pid=conn.pid, uid=conn.uid, message=why)
            await self._send(conn, {"type": "error", "message": f"refused: {why}"})
            conn.writer.close()
            return
        old = self.conns.get(conn.pid)
        if old is not None and old is not conn:
            old.writer.close()  # the same process again (it reconnected), or one that ended
        kernel = Kernel(conn.pid, server, kernel_id, uid=conn.uid, identity=conn.identity)
        hello = conn.hello or {}
        if hello.get("version", 1) >= 2:
            kernel.state = hello["state"]
            kernel.since = time.monotonic() - hello["idle_seconds"]
            self._apply(kernel, hello)
            if not kernel.slice.simulated:
                kernel.resident = 0  # NVML's, at the next look
            if kernel.state == ACTIVE:  # it runs a cell now: it keeps the room it had
                kernel.granted = kernel.budget
            if kernel.state == SUSPENDED:
                kernel.checkpoint_bytes = min(hello["resident"], kernel.slice.gpu_memory or kernel.budget)
        kernel.disk_dir = self._disk_dir_of(conn)
        conn.kernel = kernel
        self.conns[conn.pid] = conn
        self._decide("kernel joined", server=server.key, pid=conn.pid, state=kernel.state, tier=kernel.tier)
        self.metrics.joined.labels(tier=kernel.tier).inc()
        await self._send(
            conn,
            {
                "type": "welcome",
                "slice": server.slice.to_dict(),
                "server": server.key,
                "disk_dir": kernel.disk_dir,
            },
        )
        if kernel.state == SUSPENDED:
            self._spawn(self._found_suspended(kernel))
        await self._notify()

    async def _found_suspended(self, kernel: Kernel) -> None:
        """A kernel that says it is suspended, met at its hello (its checkpoint's holder,
        an arbiter before this one or chaos mode's helper, may have ended): ask the driver
        where the process is, so that it is never left locked for good. A checkpointed
        process is restored at its next cell, as any suspended kernel; one left locked by a
        suspend cut short holds its memory on the card still, and is unlocked now."""
        if self.checkpoint is None:
            why = "no driver checkpoint here; the kernel restores itself when it runs a cell"
            self._decide("suspended kernel found", server=kernel.server.key, pid=kernel.pid, message=why)
            return
        try:
            where = await self._driver(
                kernel, "state", lambda: self.checkpoint.state(*_checked([kernel.identity]))
            )
        except Exception as e:
            self._decide(
                "suspended kernel found",
                server=kernel.server.key,
                pid=kernel.pid,
                message=f"the driver cannot say where it is: {e}",
            )
            return
        if where == "locked":
            try:
                await self._driver(
                    kernel, "unlock", lambda: self.checkpoint.restore(_checked([kernel.identity]))
                )
            except Exception as e:
                self._decide("unlock failed", server=kernel.server.key, pid=kernel.pid, message=str(e))
                return
            kernel.state, kernel.checkpoint_bytes = PAUSED, 0
            why = "its suspend was cut short: unlocked, its memory had not left the card"
            self._decide("unlocked", server=kernel.server.key, pid=kernel.pid, message=why)
        elif where == "failed":
            message = "the driver's checkpoint of this kernel failed; its next cell tries to restore it"
            self._decide("checkpoint failed", server=kernel.server.key, pid=kernel.pid, message=message)
            conn = self.conns.get(kernel.pid)
            if conn is not None:
                await self._send(conn, {"type": "notice", "message": message})
        else:
            self._decide("suspended kernel found", server=kernel.server.key, pid=kernel.pid,
                         message=f"the driver says {where}; restored at its next cell")  # fmt: skip

    def _state(self, kernel: Kernel, msg: dict) -> None:
        before = kernel.tier
        if msg["state"] != kernel.state:
            kernel.state, kernel.since = msg["state"], time.monotonic()
            kernel.refused.clear()  # asked again, it may answer otherwise now
            if kernel.state != ACTIVE:
                kernel.granted = 0
            if kernel.state == SUSPENDED:
                # a suspended kernel reports what the checkpoint took off the card (NVML's
                # figure before it) as resident: the books' figure may already be 0
                said = min(msg["resident"], kernel.slice.gpu_memory or kernel.budget)
                kernel.checkpoint_bytes = max(kernel.resident, said)
        self._apply(kernel, {"disk_bytes": 0, **msg})
        if msg["resume_seconds"] is not None:
            tier = {"disk": "disk", "suspended": "suspend"}.get(before, "pause")
            self.metrics.resume_seconds.labels(gpu=kernel.slice.gpu_uuid, tier=tier).observe(
                msg["resume_seconds"]
            )

    # -- room ------------------------------------------------------------------------

    async def _prefetch(self, conn: _Conn, rid: int) -> None:
        """Bring a paused or suspended kernel back ahead of a cell its user is about to run
        (they opened, focused or edited its notebook): at once, or not at all. Granted only
        where the card has room without taking anyone off it and stays at or below its
        watermark (:func:`books.prefetch_short`), and once per ``prefetch_interval`` per
        user (all their servers); otherwise denied, and the cell asks for its room when it runs."""
        kernel = conn.kernel
        uuid = kernel.slice.gpu_uuid
        now = time.monotonic()

        async def deny(outcome: str, message: str) -> None:
            self.metrics.prefetches.labels(gpu=uuid, outcome=outcome).inc()
            self._decide("prefetch refused", server=kernel.server.key, pid=kernel.pid, message=message)
            await self._send(conn, {"type": "deny", "id": rid, "message": message})

        last = self._prefetched.get(kernel.server.user)
        if last is not None and now - last < self.config.prefetch_interval:
            await deny("too soon", f"one prefetch per {self.config.prefetch_interval:g} s per user")
            return
        async with self._locks[uuid]:
            # its state may read active already: a kernel reports so as it starts coming back
            held = kernel.state == SUSPENDED or kernel.checkpoint_bytes > 0
            if not held and kernel.state != PAUSED and kernel.paused_bytes == 0:
                await deny("not away", "nothing to bring back: the kernel is on the GPU")
                return
            reading = await self.read(uuid)
            others = [k for k in self.on_card(uuid) if k is not kernel]
            short = books.prefetch_short(kernel, reading.free, reading.total, others, self.config.watermark)
            if short > 0:
                await deny("no room", f"no room to come back ahead of the cell ({format_bytes(short)} short)")
                return
            self._prefetched[kernel.server.user] = now
            # counted as running until it reports itself idle: what it brings back is promised
            was = kernel.state
            kernel.granted = kernel.resident + kernel.paused_bytes + kernel.checkpoint_bytes
            kernel.state, kernel.since = ACTIVE, time.monotonic()
        if held and self.checkpoint is not None:  # outside the card's lock, its room held
            ok, why = await self._restore(kernel)
            if not ok:
                kernel.state, kernel.granted = was, 0
                await self._notify()
                await deny("no room", why or "the restore failed")
                return
        self._decide("prefetch", server=kernel.server.key, pid=kernel.pid, bytes=kernel.paused_bytes)
        self.metrics.prefetches.labels(gpu=uuid, outcome="granted").inc()
        await self._send(conn, {"type": "grant", "id": rid})

    async def _room(self, conn: _Conn, rid: int, purpose: str) -> None:
        kernel = conn.kernel
        uuid = kernel.slice.gpu_uuid
        t0 = time.monotonic()
        deadline = t0 + self.config.queue_timeout
        told = False

        async def tell(message: str) -> None:  # what the cell waits for now, shown in its output
            await self._send(conn, {"type": "wait", "id": rid, "message": message})

        while True:
            if self.conns.get(conn.pid) is not conn:
                return  # the kernel left: nobody to make room for
            notes: list[str] = []  # why victims stayed where they are
            async with self._locks[uuid]:
                short, reading = await self._make_room(kernel, uuid, tell, notes)
                # the kernel's word (``restore``) or the books: whichever says the driver holds
                # it, the driver is asked (a kernel reports itself active as soon as its cell
                # starts, before its room)
                held = purpose == "restore" or kernel.state == SUSPENDED
                restoring = short <= 0 and held and self.checkpoint is not None
                if short <= 0:  # its room is its own from here: a kernel running, as the books see it
                    was = kernel.state
                    others = [k for k in self.on_card(uuid) if k is not kernel]
                    kernel.granted = books.growth(kernel, reading.free, others)
                    kernel.state, kernel.since = ACTIVE, time.monotonic()
            if restoring:
                # outside the card's lock: a restore that hangs holds up no other kernel. A word
                # each second while the driver restores (tens of seconds for tens of GiB): the
                # cell is never silent, and the kernel never takes the silence for a hung arbiter
                ok, why = await said_while(
                    self._restore(kernel), tell, "restoring this kernel from the driver's checkpoint"
                )
                if not ok:
                    kernel.state, kernel.granted = was, 0  # as it was, its room given back
                    await self._notify()
                if ok is None:  # NVML shows less free than the restore needs: wait for it
                    short = 1
                    notes.append(why)
                elif not ok:
                    await self._send(conn, {"type": "deny", "id": rid, "message": why})
                    return
            if short <= 0:
                if kernel.tier in ("host", "disk"):
                    where = "disk" if kernel.tier == "disk" else "host memory"
                    back = format_bytes(kernel.paused_bytes)
                    await tell(f"room granted: bringing {back} back from {where}")
                waited = time.monotonic() - t0
                self.metrics.queue_wait.labels(gpu=uuid).observe(waited)
                await self._send(conn, {"type": "grant", "id": rid})
                failpoints.hit("arbiter.grant")
                return
            running = [k for k in self.on_card(uuid) if k.state == ACTIVE and k is not kernel]
            message = (
                f"waiting for GPU memory on GPU {kernel.slice.gpu_index}: {len(running)} session(s) running, "
                f"{format_bytes(short + reading.free)} needed, {format_bytes(reading.free)} free"
            )
            if notes:
                message += f"; {notes[-1]}"
            if time.monotonic() >= deadline:
                self._decide("denied", server=kernel.server.key, gpu=uuid, message=message)
                await self._send(
                    conn,
                    {
                        "type": "deny",
                        "id": rid,
                        "message": f"no room on the GPU after {self.config.queue_timeout:.0f} s ({message})",
                    },
                )
                return
            if not told:
                self._decide("queued", server=kernel.server.key, gpu=uuid, message=message)
                told = True
            await self._send(conn, {"type": "wait", "id": rid, "message": message})
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), 1.0)

    async def _make_room(self, kernel: Kernel, uuid: str, tell=None, notes=None) -> tuple[int, Reading]:
        """Pause or suspend idle kernels until ``kernel`` fits; returns what is still short.
        ``await tell(message)`` hears what is being done and why, as it starts."""
        reading = await self.read(uuid)
        others = [k for k in self.on_card(uuid) if k is not kernel]
        short = books.shortfall(kernel, reading.free, others)
        if short <= 0:
            return short, reading
        for victim, action in books.victims(others, kernel, self.config.suspend_after):
            if action == "suspend" and self.checkpoint is None:
                continue
            if victim.declined(action, time.monotonic(), REFUSAL_SECONDS):
                if notes is not None:  # asking again would get the same answer, or none
                    notes.append(f"{victim.server.key} stays: it declined to {action} a moment ago")
                continue
            taking = self._take_off(
                victim, action, Reason.ROOM, for_whom=kernel.server.key, tell=tell, notes=notes
            )
            if tell is None:
                ok = await taking
            else:  # a word each second: a suspend of tens of GiB takes tens of seconds
                verb = "pausing" if action == "pause" else "suspending"
                ok = await said_while(
                    taking,
                    tell,
                    f"making room on GPU {kernel.slice.gpu_index}: {verb} {victim.server.key} "
                    f"(idle {victim.idle_for():.0f} s), {format_bytes(short)} still to free",
                )
            if not ok:
                continue
            reading = await self.read(uuid)
            short = books.shortfall(kernel, reading.free, [k for k in self.on_card(uuid) if k is not kernel])
            if short <= 0:
                break
        return short, reading

    async def _take_off(
        self, kernel: Kernel, action: str, reason: Reason, for_whom: str = "", tell=None, notes=None
    ) -> bool:
        """Pause (or pause, then suspend) ``kernel``; True when its memory left the card.
        Host memory for it is made first (:meth:`_host_room`); where none can be, it stays.

        A kernel that cannot be paused safely (it says why: a thread that may use the GPU
        while idle, child processes on the GPU...) is suspended instead, where the
        driver's checkpoint is available; one the driver cannot suspend (CUDA IPC, managed
        memory) pauses in part, what is shared or managed staying on the card, and refuses
        a suspend later. A suspend takes the kernel's child processes that hold memory on
        the card with it.
        """
        conn = self.conns.get(kernel.pid)
        if conn is None:
            return False
        need = tiers.host_need(kernel)
        why = await self._host_room(kernel, need, tell)
        if why is not None:
            self._decide(f"{action} skipped", server=kernel.server.key, pid=kernel.pid, message=why)
            if notes is not None:
                notes.append(f"{kernel.server.key} stays: {why}")
            return False
        uuid = kernel.slice.gpu_uuid
        t0 = time.monotonic()
        reading = await self.read(uuid)
        before = reading.used
        measured = None if kernel.slice.simulated else kernel.resident  # NVML's, just read
        answer = await conn.ask(
            {"type": action}, self.config.pause_timeout, sent=lambda: failpoints.hit("arbiter.pause")
        )
        self._heard(kernel, action, answer)
        if (
            not answer.get("ok")
            and action == "pause"
            and self.checkpoint is not None
            and not answer.get("timeout")
        ):
            self._decide("pause refused", server=kernel.server.key, message=answer.get("message", ""))
            action = "suspend"
            answer = await conn.ask({"type": action}, self.config.pause_timeout)
            self._heard(kernel, action, answer)
        if not answer.get("ok"):
            self._decide(f"{action} refused", server=kernel.server.key, message=answer.get("message", ""))
            if notes is not None:
                notes.append(f"{kernel.server.key} stays: {answer.get('message', '')}")
            return False
        if action == "suspend":
            failpoints.hit("arbiter.suspend")
            group = self._group_of(kernel, reading.processes)
            # what the checkpoint takes off the card, after the kernel's own pause: its restore needs it back
            held = (await self.read(uuid)).processes
            kernel.checkpoint_bytes = sum(held.get(i.pid, 0) for i in group)
            try:
                await self._driver(
                    kernel,
                    "suspend",
                    lambda: self.checkpoint.suspend(_checked(group), nbytes=kernel.checkpoint_bytes),
                )
            except Exception as e:
                procs.close_quietly(group[:-1])
                self._decide("suspend failed", server=kernel.server.key, message=str(e))
                return False
            kernel.group, kernel.group_ids = [i.pid for i in group], group
            kernel.state, kernel.since = SUSPENDED, time.monotonic()
            self.metrics.suspends.labels(gpu=uuid).inc()
        else:
            kernel.state = PAUSED
            kernel.measured = measured
            self.metrics.pauses.labels(gpu=uuid, reason=reason.value).inc()
        released = answer.get("released")  # bytes; absent from a suspend's answer
        if released != 0:  # a pause that released nothing leaves nothing to wait for
            await self._settle(uuid, before)
        took = time.monotonic() - t0
        fields = {"released": released} if released is not None else {}
        if action == "suspend" and len(kernel.group) > 1:
            fields["with"] = ",".join(map(str, kernel.group[:-1]))
        said = f"room for {for_whom}" if reason is Reason.ROOM else reason.value
        self._decide(
            action, server=kernel.server.key, pid=kernel.pid, reason=said, seconds=round(took, 3), **fields
        )
        return True

    def _heard(self, kernel: Kernel, action: str, answer: dict) -> None:
        """Note a kernel's answer to ``action``: a refusal stands a while
        (:data:`REFUSAL_SECONDS`, or until its state changes), and a request it let go
        unanswered leaves it alone for :data:`UNRESPONSIVE_SECONDS`, unless it answers
        something sooner: no kernel holds up a decision twice by keeping silent."""
        now = time.monotonic()
        if answer.get("ok"):
            kernel.unresponsive_until = 0.0
            kernel.refused.pop(action, None)
            return
        kernel.refused[action] = now
        if answer.get("timeout"):
            kernel.unresponsive_until = now + UNRESPONSIVE_SECONDS
            self._decide(
                "kernel unresponsive", server=kernel.server.key, pid=kernel.pid,
                message=f"no answer to {action}: not asked again for {UNRESPONSIVE_SECONDS:.0f} s",
            )  # fmt: skip

    def _group_of(self, kernel: Kernel, on_card) -> list[procs.Identity]:
        """The processes a suspend of ``kernel`` takes, the kernel last: its descendants
        holding memory on the card (``on_card``: PIDs) that are of its uid and its server,
        each as a :class:`.procs.Identity` taken now."""
        group = []
        for pid in on_card:
            if pid == kernel.pid or kernel.pid not in peers.ancestors(pid):
                continue
            ident = procs.Identity.of(pid, uid=kernel.uid)
            if ident is not None and self.root_of(pid) == kernel.server.root:
                group.append(ident)
            elif ident is not None:
                ident.close()
        return [*group, kernel.identity]

    async def _driver(self, kernel: Kernel, what: str, call):
        """``call()`` (a call of the driver's checkpoint about ``kernel``, each bounded by
        the :mod:`.checkpoint_pool`) in the executor. While it lasts, the books show it
        (``driver_call``: which call, since when); one given up past its deadline is a
        decision, and the kernel hears of it (``%vgpu status`` shows the notice).

        Raises:
            Exception: whatever ``call`` raised.
        """
        kernel.driver_call = (what, time.time())
        try:
            return await asyncio.get_running_loop().run_in_executor(None, call)
        except Exception as e:
            if isinstance(e, getattr(self.checkpoint, "Timeout", ())):
                self._decide("driver call given up", server=kernel.server.key, pid=kernel.pid, message=str(e))
                conn = self.conns.get(kernel.pid)
                if conn is not None:
                    notice = f"{e}. If this kernel does not answer, restart it."
                    await self._send(conn, {"type": "notice", "message": notice})
            raise
        finally:
            kernel.driver_call = None

    async def _settle(self, uuid: str, before: int, timeout: float = 2.0) -> None:
        """Wait (briefly) for NVML to show the memory a pause released."""
        if self._simulated_total(uuid) is not None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (await self.read(uuid)).used < before:
                return
            await asyncio.sleep(0.02)

    async def _restore(self, kernel: Kernel) -> tuple[bool | None, str]:
        """Bring ``kernel`` (and its group) back from the driver's checkpoint, if the driver
        holds it; ``(True, "")`` once it runs (restored now, or it was not checkpointed),
        ``(None, why)`` when NVML shows too little free memory to try (a restore the card
        has no room for leaves the process unrestorable: :mod:`.checkpoint`), ``(False,
        why)`` when the driver refused."""
        if not kernel.group and not kernel.checkpoint_bytes:
            # not suspended by this arbiter, nor with a footprint: only the kernel's word
            # says so (chaos mode's helper, or a kernel suspended before it touched CUDA)
            try:
                where = await self._driver(
                    kernel, "state", lambda: self.checkpoint.state(*_checked([kernel.identity]))
                )
            except Exception:  # no CUDA context in it: nothing the driver holds
                where = "running"
            if where == "running":
                return True, ""
        failpoints.hit("arbiter.restore")
        # logged before the driver's call, so that a restore that never ends shows in the log
        log.info("restoring %s from the driver's checkpoint (group %s)", kernel.describe(), kernel.group)
        need = {kernel.slice.gpu_uuid: kernel.checkpoint_bytes} if not kernel.slice.simulated else None
        group = kernel.group_ids
        if not group:  # suspended by another: its descendants of its own user, as they are now
            found = [procs.Identity.of(p, uid=kernel.uid) for p in _descendants(kernel.pid, kernel.uid)]
            group = [*(i for i in found if i is not None), kernel.identity]
        try:
            seconds = await self._driver(
                kernel, "restore", lambda: self.checkpoint.restore(_checked(group), need)
            )
        except self.checkpoint.NoRoom as e:
            return None, f"{kernel.server.key} waits to be restored: {e}"
        except Exception as e:
            return False, f"restoring the kernel failed: {e}"
        finally:
            if group is not kernel.group_ids:
                procs.close_quietly(group[:-1])
        procs.close_quietly(kernel.group_ids[:-1])
        kernel.checkpoint_bytes, kernel.group, kernel.group_ids = 0, [], []
        self.metrics.resume_seconds.labels(gpu=kernel.slice.gpu_uuid, tier="suspend").observe(seconds)
        self._decide("restored", server=kernel.server.key, pid=kernel.pid, seconds=round(seconds, 3))
        return True, ""

    # -- budgets -----------------------------------------------------------------------

    async def managed_cards(self) -> set[str]:
        """The real cards whose processes the watchdog looks at: those of the registered
        slices, and ``ArbiterApp.managed_gpus`` (by default every GPU, or MIG instance,
        NVML lists on this host; read once)."""
        cards_now = {s.slice.gpu_uuid for s in self.servers.values() if not s.slice.simulated}
        if self._managed is None:
            self._managed = await asyncio.get_running_loop().run_in_executor(None, self._list_managed)
        return cards_now | self._managed

    def _list_managed(self) -> set[str]:
        wanted = list(getattr(self.config, "managed_gpus", None) or ["all"])
        try:
            from jupyter_vgpu import nvml

            devices = []
            for g in nvml.list_gpus():
                if g.mig_enabled:
                    devices += [(m.uuid, str(g.index), g.uuid) for m in nvml.mig_devices(g.index)]
                else:
                    devices.append((g.uuid, str(g.index), g.uuid))
        except Exception as e:  # no driver: only simulated cards, nothing to police
            log.info("no GPU to watch beyond the slices' (%s)", e)
            return set()
        return {
            uuid for uuid, index, parent in devices if "all" in wanted or {uuid, index, parent} & set(wanted)
        }

    def allowed(self, pid: int) -> bool:
        """Whether a process of no server may use a managed card: this arbiter and its
        ancestors (the Hub) always; else as :func:`.allowlist.judge` says of the process
        (``ArbiterApp.allowed_executables``, ``allowed_cgroups``). A process gone
        meanwhile, or one ``/proc`` cannot tell about, is allowed (nothing to act on)."""
        if pid in self.protected:
            return True
        ok, why = allowlist.judge(
            pid, getattr(self.config, "allowed_executables", ()), getattr(self.config, "allowed_cgroups", ())
        )
        if not ok and pid in self.unowned:
            self.unowned[pid]["why"] = why
        return ok

    async def enforce(self, now: float) -> None:
        """Compare every server's processes on the managed cards, together, with its
        budget, and find the cards' processes that belong to no server (real cards)."""
        processes: dict[int, int] = {}
        by_card: dict[int, dict[str, int]] = {}
        read: set[str] = set()
        for uuid in sorted(await self.managed_cards()):
            try:
                reading = await self.read(uuid)
            except Exception as e:
                log.warning("cannot read GPU %s: %s", uuid, e)
                continue
            read.add(uuid)
            for pid, used in reading.processes.items():
                processes[pid] = processes.get(pid, 0) + used
                by_card.setdefault(pid, {})[uuid] = used
        seen = self._identify(processes)
        processes = {pid: used for pid, used in processes.items() if pid in seen}
        by_card = {pid: cards for pid, cards in by_card.items() if pid in seen}
        self._card_of = {pid: max(cards, key=cards.__getitem__) for pid, cards in by_card.items()}
        owner = owners(self.servers.values(), self.mapping, read)
        actions = self.watchdog.step(now, processes, owner, self.allowed, by_card)
        self.unowned = {
            pid: entry for pid, entry in self.unowned.items() if pid in processes and owner(pid) is None
        }
        for action in actions:
            await self._act(action, self._card_of.get(action.pid, ""))
        for uuid in {self._card_of.get(pid, "") for pid in self.unowned} | set(self._unowned_cards):
            self.metrics.unowned.labels(gpu=uuid).set(
                sum(1 for pid in self.unowned if self._card_of.get(pid) == uuid)
            )
        self._unowned_cards = {self._card_of.get(pid, "") for pid in self.unowned}

    def _identify(self, pids) -> dict[int, procs.Identity]:
        """Each process of ``pids`` (on the cards now) as a :class:`.procs.Identity`, kept
        from the look before where it is still the same process, taken now otherwise; a
        process ``/proc`` cannot tell about is left out of this look (unknown: nothing is
        done to it, it is not taken for unowned)."""
        seen = {}
        for pid in pids:
            ident = self._seen.get(pid)
            if ident is None or not ident.current():
                ident = procs.Identity.of(pid)
            if ident is not None:
                seen[pid] = ident
        procs.close_quietly(i for pid, i in self._seen.items() if seen.get(pid) is not i)
        self._seen = seen
        return seen

    async def _act(self, action, uuid: str) -> None:
        if action.unowned:
            await self._act_unowned(action, uuid)
            return
        what = "wrong GPU" if action.wrong_gpu else "over budget"
        self._decide(
            f"{what}: {action.kind}", server=action.server, pid=action.pid, used=action.used,
            total=action.total, budget=action.budget, mapped_by=action.mapped_by, message=action.message(),
            **({"gpus": [uuid for uuid, _ in action.elsewhere]} if action.wrong_gpu else {}),
        )  # fmt: skip
        self.metrics.enforcement.labels(gpu=uuid, action=action.kind).inc()
        kernel_pid = peers.root_in(action.pid, self.conns)  # the kernel it runs under, if any
        conn = self.conns.get(kernel_pid) if kernel_pid is not None else None
        key = self.root_of(action.pid)
        for other in self.conns.values():  # every kernel of the server hears of it
            if other.kernel is not None and other.kernel.server.root == key:
                await self._send(other, {"type": "notice", "message": action.message()})
        if action.kind == "kill":
            server = self.server_of(action.pid)
            ident = self._seen.get(action.pid)
            if (
                server is not None
                and server.uid is not None
                and ident is not None
                and ident.uid != server.uid
            ):
                why = (
                    f"not ended: it runs as uid {ident.uid}, not as {server.key}'s account (uid {server.uid})"
                )
                self._decide("not ended", server=action.server, pid=action.pid, message=why)
            else:
                self._end(action.pid)
        elif action.kind == "pause" and conn is not None and conn.kernel.state in (books.IDLE,):
            await self._take_off(
                conn.kernel, "pause", Reason.WRONG_GPU if action.wrong_gpu else Reason.OVER_BUDGET
            )

    def _end(self, pid: int) -> None:
        """SIGKILL to the process ``pid`` was when the watchdog last looked (through its
        identity: never to a process that took its PID since), never this arbiter or the Hub."""
        ident = self._seen.get(pid)
        if pid in self.protected or ident is None:
            return
        if not ident.send(signal.SIGKILL):
            self._decide("not ended", pid=pid, message="it ended, or its PID names another process now")

    async def _act_unowned(self, action, uuid: str) -> None:
        """Report (log, books, Hub page, metric) and, under ``unowned_policy``, end a
        process that uses a managed card and belongs to no server."""
        entry = self.unowned.get(action.pid)
        if entry is None:
            entry = {"pid": action.pid, "gpu": uuid, "since": time.time(), **procs.describe(action.pid)}
            self.unowned[action.pid] = entry
        entry["used"] = action.used
        self._decide(
            f"unowned: {action.kind}", gpu=uuid, pid=action.pid, used=action.used, mapped_by="unowned",
            message=f"{action.message()}: {entry['exe'] or '?'}, uid {entry['uid']}, "
            f"cgroup {entry['cgroup'] or '?'}",
        )  # fmt: skip
        self.metrics.unowned_actions.labels(gpu=uuid, action=action.kind).inc()
        if action.kind == "kill":
            self._end(action.pid)

    # -- in the background -----------------------------------------------------------

    async def _background(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_seconds)
            try:
                await self.tick()
            except Exception:
                log.exception("background step failed")

    async def tick(self) -> None:
        """One background step: the budgets' watchdog, then, on cards where no kernel runs
        code, pause idle kernels on full cards and suspend long-idle ones."""
        now = time.monotonic()
        await self.enforce(now)
        await self._watch_mps(now)
        await self._tiers(now)
        for uuid in {k.slice.gpu_uuid for k in self.kernels}:
            if self._locks[uuid].locked():
                continue  # a room request is deciding on this card
            async with self._locks[uuid]:
                kernels = self.on_card(uuid)
                if not books.quiet(kernels):
                    continue  # a cell runs on this card: background work waits (books.quiet)
                reading = await self.read(uuid)
                todo = books.ahead_of_time(kernels, reading.used, reading.total, self.config.watermark, now)
                if self.checkpoint is not None and self.config.suspend_after > 0:
                    todo += [
                        (k, "suspend")
                        for k in kernels
                        if k.state == PAUSED and k.idle_for(now) >= self.config.suspend_after
                    ]
                for kernel, action in todo:
                    if not books.quiet(self.on_card(uuid)):
                        break  # a cell started meanwhile: the rest waits for the next quiet look
                    await self._take_off(kernel, action, Reason.IDLE)
