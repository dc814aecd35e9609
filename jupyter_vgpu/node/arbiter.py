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
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from jupyter_vgpu import failpoints
from jupyter_vgpu.slice import Slice, SliceError
from jupyter_vgpu.units import format_bytes

from . import books, cards, cgroups, disk, handoff, mps, namespaces, peers, protocol, slurm, tiers
from .books import ACTIVE, IDLE, PAUSED, SUSPENDED, TIERS, Kernel, Server
from .cards import Reading
from .journal import Journal
from .metrics import Metrics
from .watchdog import Watchdog, owners

log = logging.getLogger("jupyter_vgpu.node")
T = TypeVar("T")


def _descendants(pid: int) -> list[int]:
    """Every process descending from ``pid`` (from ``/proc``): the processes a kernel may
    have been suspended with, when the arbiter that suspended it is not this one."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    return [p for p in pids if p != pid and pid in peers.ancestors(p)]


def _root_only(path: str) -> bool:
    """Whether the directory holding ``path`` and the file itself are writable by root alone."""
    try:
        for p in (os.path.dirname(path), path):
            st = os.stat(p)
            if st.st_uid != 0 or st.st_mode & 0o022:
                return False
    except OSError:
        return False
    return True


def _describe(pid: int) -> dict:
    """What /proc says of a process: its executable, uid and cgroup (None where unreadable)."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = None
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        uid = None
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            cgroup = next((line.split(":", 2)[2].strip() for line in f if line.startswith("0::")), None)
    except OSError:
        cgroup = None
    return {"exe": exe, "uid": uid, "cgroup": cgroup}


def _disk_error(message: str) -> bool:
    """True when a kernel's refusal to spill names an error of the file system (``OSError``
    and its kinds, ``SpillError``), not of the kernel (suspended, not paused)."""
    name = message.split(":", 1)[0].strip()
    kind = getattr(builtins, name, None)
    return name == "SpillError" or (isinstance(kind, type) and issubclass(kind, OSError))


class _Conn:
    """One connected client."""

    def __init__(self, reader, writer, pid: int, uid: int, trusted: bool):
        self.reader, self.writer = reader, writer
        self.pid, self.uid, self.trusted = pid, uid, trusted
        self.kernel: Kernel | None = None
        self.hello: dict | None = None  # its hello, with the figures of its latest state
        self.pending: dict[int, asyncio.Future] = {}
        self.next_id = 1
        self.node_sent: tuple | None = None  # the node figures it was last told

    async def send(self, msg: dict) -> None:
        self.writer.write(protocol.encode(msg))
        await self.writer.drain()

    async def ask(self, msg: dict, timeout: float, sent=None) -> dict:
        """Send a request and wait for its reply (``{"ok": False}`` on timeout or hang-up);
        ``sent()`` is called once it is sent (a failpoint)."""
        rid = self.next_id
        self.next_id += 1
        future = asyncio.get_running_loop().create_future()
        self.pending[rid] = future
        try:
            await self.send({**msg, "id": rid})
            if sent is not None:
                sent()
            return await asyncio.wait_for(future, timeout)
        except (TimeoutError, ConnectionError):
            return {"ok": False, "message": f"no answer within {timeout:.0f} s"}
        finally:
            self.pending.pop(rid, None)


#: Seconds between two looks at the MPS daemons this arbiter started.
MPS_WATCH_SECONDS = 10.0
#: Seconds between two sweeps of the disk tier for directories of kernels that ended.
SWEEP_SECONDS = 5.0
#: Seconds the disk tier is left alone after a spill failed (a full or failing disk).
DISK_BACKOFF_SECONDS = 30.0


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
        self.disk_problem: str | None = None  # why the disk tier failed last, while it is left alone
        self._disk_retry = 0.0  # monotonic seconds after which the disk tier is tried again
        self._swept = 0.0
        self._spilling: asyncio.Task | None = None
        self._spills: dict[int, asyncio.Future] = {}  # kernel pid -> its spill in progress
        self.started = time.monotonic()

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
        roots = {s.pid: s.root for s in self.servers.values() if s.pid and not s.pod_uid and not s.job_id}
        root = peers.root_in(pid, roots) if roots else None
        return roots[root] if root is not None else None

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
    ) -> Server:
        """Give a server a slice (from the Hub or a trusted client): every process in its
        ``cgroup`` (a path in ``cgroup_hierarchy``) and below, or (``pid`` 0) every
        process of the pod ``pod_uid`` or of the Slurm job ``job_id``, or the process
        tree rooted at ``pid``."""
        server = Server(
            pid, user, name, slice_, pod_uid, job_id=job_id, cgroup=cgroup, cgroup_hierarchy=cgroup_hierarchy
        )
        root = server.root
        old = self.servers.get(root)
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
        root = self.disk_root
        return {
            "host_used": tiers.host_used(kernels),
            "host_limit": self.host_budget().limit,
            "host_available": tiers.meminfo().get("MemAvailable", 0),
            "disk_used": tiers.disk_used(kernels),
            "disk_free": disk.free_bytes(root) if root else None,
            "disk_dir": root or None,
            "disk_problem": self.disk_problem,
            "tiers": {t: sum(1 for k in kernels if k.tier == t) for t in TIERS},
        }

    def _disk_dir_of(self, conn: _Conn) -> str | None:
        """The disk tier directory of the kernel on ``conn`` (made at its first spill)."""
        if not self.disk_root:
            return None
        return disk.kernel_dir(self.disk_root, conn.uid, conn.pid)

    def _disk_usable(self, need: int) -> str | None:
        """Why ``need`` more bytes cannot go to the disk tier now (None: they can)."""
        if not self.disk_root:
            return "there is no disk tier (ArbiterApp.disk_dir is empty)"
        if time.monotonic() < self._disk_retry:
            return self.disk_problem or "the disk tier failed a moment ago"
        limit = getattr(self.config, "disk_limit", None)
        used = tiers.disk_used(self.kernels)
        if limit is not None and used + need > limit:
            return f"the disk tier holds {format_bytes(used)} of its {format_bytes(limit)} limit"
        free = disk.free_bytes(self.disk_root)
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
        try:  # the user's directory, theirs and private
            await asyncio.get_running_loop().run_in_executor(None, disk.user_dir, self.disk_root, kernel.uid)
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
        if not answer.get("ok"):
            self.metrics.spill_failures.inc()
            if _disk_error(answer.get("message", "")):  # a full or failing disk: left alone a while
                self.disk_problem = f"spilling {kernel.server.key} failed: {answer.get('message', '')}"
                self._disk_retry = time.monotonic() + DISK_BACKOFF_SECONDS
            self._decide(
                "spill failed", server=kernel.server.key, pid=kernel.pid, message=answer.get("message", "")
            )
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
        the victim next (a kernel larger than the budget on its own)."""
        asked: list[Kernel] = []  # to trim: one that gave nothing back is not asked again
        while True:
            budget = self.host_budget()
            available = tiers.meminfo().get("MemAvailable", 0)
            over_budget, over_reserve = tiers.host_room(self.kernels, budget, need, available)
            if not over_budget and not over_reserve:
                return None
            held = format_bytes(tiers.host_used(self.kernels))
            why = (
                f"host memory for paused kernels is full ({held} of {format_bytes(budget.limit)} held, "
                f"{format_bytes(available)} available)"
            )
            warm = tiers.trimmable(self.kernels, time.monotonic(), exclude=(victim, *asked))
            if warm:
                asked.append(warm[0])
                if await self.trim(warm[0]):
                    continue  # losing no data comes before moving any to disk
            candidates = tiers.spillable(self.kernels, time.monotonic(), exclude=(victim,))
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
            before = candidates[0].host_bytes
            if not await self.spill(candidates[0], tell) or candidates[0].host_bytes >= before:
                disk_why = (
                    self.disk_problem or self._disk_usable(candidates[0].host_bytes) or "it moved nothing"
                )
                return f"{why}, and the disk tier takes nothing now: {disk_why}"

    async def _spill_coldest(self) -> None:
        """Trim idle kernels' warm slabs, then spill the coldest paused kernels, while the
        node is over its spill mark."""
        for kernel in tiers.to_trim(
            self.kernels, self.host_budget(), tiers.meminfo().get("MemAvailable", 0), time.monotonic()
        ):
            await self.trim(kernel)
        while True:
            todo = tiers.to_spill(
                self.kernels, self.host_budget(), tiers.meminfo().get("MemAvailable", 0), time.monotonic()
            )
            if not todo or self._disk_usable(todo[0].host_bytes) is not None:
                return
            before = todo[0].host_bytes
            if not await self.spill(todo[0]) or todo[0].host_bytes >= before:
                return  # refused, or it held nothing it could move

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
        if self.disk_root and now - self._swept >= SWEEP_SECONDS:
            self._swept = now
            removed = await asyncio.get_running_loop().run_in_executor(None, disk.sweep, self.disk_root)
            for path in removed:
                self._decide("disk tier freed", message=f"{path}: its kernel has ended")

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
        """Listen on ``path`` (its directory is made, owned by us, writable by us alone),
        once the arbiter serving it before has handed over (:mod:`.handoff`); slices
        registered over the socket before a restart come back from the journal."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o755)
        loop = asyncio.get_running_loop()
        self._lock_fd = await loop.run_in_executor(None, handoff.take, path.parent / "arbiter.lock")
        if self.config.registrars != "none":
            self.journal = Journal(path.parent / "registrations.json")
            for pid, user, name, slice_ in self.journal.load():
                self.register(pid, user, name, slice_)
        if self.disk_root:
            for gone in await loop.run_in_executor(None, disk.sweep, self.disk_root):
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

    async def _send(self, conn: _Conn, msg: dict) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            await conn.send(msg)

    async def _serve(self, reader, writer) -> None:
        pid, uid, _ = peers.peer_credentials(writer.get_extra_info("socket"))
        conn = _Conn(reader, writer, pid, uid, trusted=uid in (0, os.getuid()))
        try:
            while True:
                try:
                    line = await reader.readline()
                except (asyncio.LimitOverrunError, ValueError):
                    await self._send(conn, {"type": "error", "message": "line too long"})
                    return
                if not line:
                    return
                try:
                    msg = protocol.decode(line)
                except protocol.ProtocolError as e:
                    await self._send(conn, {"type": "error", "message": str(e)})
                    continue
                await self._dispatch(conn, msg)
        except ConnectionError:
            pass
        finally:
            if self.unknown.get(conn.pid, (None,))[0] is conn:
                del self.unknown[conn.pid]
            if conn.kernel is not None and self.conns.get(conn.pid) is conn:
                del self.conns[conn.pid]
                self._decide("kernel left", server=conn.kernel.server.key, pid=conn.pid)
                where = conn.kernel.disk_dir
                if where and disk.start_time(conn.pid) is None:  # ended: its disk tier goes too
                    self._spawn(asyncio.get_running_loop().run_in_executor(None, disk.remove, where))
                await self._notify()
            for future in conn.pending.values():
                if not future.done():
                    future.set_result({"ok": False, "message": "the kernel hung up"})
            writer.close()

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
        elif kind == "room" and msg["for"] == "prefetch":
            self._spawn(self._prefetch(conn, msg["id"]))
        elif kind == "room":
            self._spawn(self._room(conn, msg["id"], msg["for"]))
        elif kind == "reply":
            future = conn.pending.get(msg["id"])
            if future is not None and not future.done():
                future.set_result(msg)

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
            self.register(
                msg["pid"], msg["user"], msg["server"], slice_, cgroup=cgroup, cgroup_hierarchy=hierarchy
            )
            if self.journal is not None:
                self.journal.add(msg["pid"], msg["user"], msg["server"], slice_)
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

    async def _admit(self, conn: _Conn, server: Server, kernel_id: str) -> None:
        old = self.conns.get(conn.pid)
        if old is not None and old is not conn:
            old.writer.close()
        kernel = Kernel(conn.pid, server, kernel_id, uid=conn.uid)
        hello = conn.hello or {}
        if hello.get("version", 1) >= 2:
            kernel.state = hello["state"]
            kernel.since = time.monotonic() - hello["idle_seconds"]
            kernel.resident = hello["resident"]
            kernel.paused_bytes, kernel.host_bytes = hello["paused_bytes"], hello["host_bytes"]
            kernel.disk_bytes = hello.get("disk_bytes", 0)
            if kernel.state == ACTIVE:  # it runs a cell now: it keeps the room it had
                kernel.granted = kernel.budget
            if kernel.state == SUSPENDED:
                kernel.checkpoint_bytes = kernel.resident
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
        loop = asyncio.get_running_loop()
        try:
            where = await loop.run_in_executor(None, self.checkpoint.state, kernel.pid)
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
                await loop.run_in_executor(None, self.checkpoint.restore, kernel.pid)
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
            if kernel.state != ACTIVE:
                kernel.granted = 0
            if kernel.state == SUSPENDED:
                # a suspended kernel reports what the checkpoint took off the card (NVML's
                # figure before it) as resident: the books' figure may already be 0
                kernel.checkpoint_bytes = max(kernel.resident, msg["resident"])
        if kernel.slice.simulated:  # no counters: the kernel's figure is all there is
            kernel.resident = msg["resident"]
        kernel.paused_bytes, kernel.host_bytes = msg["paused_bytes"], msg["host_bytes"]
        kernel.disk_bytes = msg.get("disk_bytes", 0)
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
            if held and self.checkpoint is not None:
                ok, why = await self._restore(kernel)
                if not ok:
                    await deny("no room", why or "the restore failed")
                    return
            # counted as running until it reports itself idle: what it brings back is promised
            kernel.granted = kernel.resident + kernel.paused_bytes
            kernel.state, kernel.since = ACTIVE, time.monotonic()
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
                held = purpose == "restore" or kernel.state == SUSPENDED
                if short <= 0 and held and self.checkpoint is not None:
                    # the kernel's word (``restore``) or the books: whichever says the driver
                    # holds it, the driver is asked (a kernel reports itself active as soon
                    # as its cell starts, before its room). A word each second while the
                    # driver restores (tens of seconds for tens of GiB): the cell is never
                    # silent, and the kernel never takes the silence for a hung arbiter
                    ok, why = await said_while(
                        self._restore(kernel), tell, "restoring this kernel from the driver's checkpoint"
                    )
                    if ok is None:  # NVML shows less free than the restore needs: wait for it
                        short = 1
                        notes.append(why)
                    elif not ok:
                        await self._send(conn, {"type": "deny", "id": rid, "message": why})
                        return
                if short <= 0:
                    if kernel.tier in ("host", "disk"):
                        where = "disk" if kernel.tier == "disk" else "host memory"
                        await tell(
                            f"room granted: bringing {format_bytes(kernel.paused_bytes)} back from {where}"
                        )
                    others = [k for k in self.on_card(uuid) if k is not kernel]
                    kernel.granted = books.growth(kernel, reading.free, others)
                    kernel.state, kernel.since = ACTIVE, time.monotonic()
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
            for_whom = f"room for {kernel.server.key}"
            taking = self._take_off(victim, action, reason=for_whom, tell=tell, notes=notes)
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

    async def _take_off(self, kernel: Kernel, action: str, reason: str, tell=None, notes=None) -> bool:
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
        answer = await conn.ask(
            {"type": action}, self.config.pause_timeout, sent=lambda: failpoints.hit("arbiter.pause")
        )
        if not answer.get("ok") and action == "pause" and self.checkpoint is not None:
            self._decide("pause refused", server=kernel.server.key, message=answer.get("message", ""))
            action = "suspend"
            answer = await conn.ask({"type": action}, self.config.pause_timeout)
        if not answer.get("ok"):
            self._decide(f"{action} refused", server=kernel.server.key, message=answer.get("message", ""))
            if notes is not None:
                notes.append(f"{kernel.server.key} stays: {answer.get('message', '')}")
            return False
        if action == "suspend":
            failpoints.hit("arbiter.suspend")
            group = [p for p in reading.processes if p != kernel.pid and kernel.pid in peers.ancestors(p)]
            group.append(kernel.pid)
            # what the checkpoint takes off the card, after the kernel's own pause: its restore needs it back
            held = (await self.read(uuid)).processes
            kernel.checkpoint_bytes = sum(held.get(p, 0) for p in group)
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.checkpoint.suspend, group)
            except Exception as e:
                self._decide("suspend failed", server=kernel.server.key, message=str(e))
                return False
            kernel.group = group
            kernel.state, kernel.since = SUSPENDED, time.monotonic()
            self.metrics.suspends.labels(gpu=uuid).inc()
        else:
            kernel.state = PAUSED
            self.metrics.pauses.labels(gpu=uuid, reason="room" if reason.startswith("room") else "idle").inc()
        released = answer.get("released")  # bytes; absent from a suspend's answer
        if released != 0:  # a pause that released nothing leaves nothing to wait for
            await self._settle(uuid, before)
        took = time.monotonic() - t0
        fields = {"released": released} if released is not None else {}
        if action == "suspend" and len(kernel.group) > 1:
            fields["with"] = ",".join(map(str, kernel.group[:-1]))
        self._decide(
            action, server=kernel.server.key, pid=kernel.pid, reason=reason, seconds=round(took, 3), **fields
        )
        return True

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
        loop = asyncio.get_running_loop()
        if not kernel.group and not kernel.checkpoint_bytes:
            # not suspended by this arbiter, nor with a footprint: only the kernel's word
            # says so (chaos mode's helper, or a kernel suspended before it touched CUDA)
            try:
                where = await loop.run_in_executor(None, self.checkpoint.state, kernel.pid)
            except Exception:  # no CUDA context in it: nothing the driver holds
                where = "running"
            if where == "running":
                return True, ""
        failpoints.hit("arbiter.restore")
        # logged before the driver's call, so that a restore that never ends shows in the log
        log.info("restoring %s from the driver's checkpoint (group %s)", kernel.describe(), kernel.group)
        need = {kernel.slice.gpu_uuid: kernel.checkpoint_bytes} if not kernel.slice.simulated else None
        try:
            seconds = await loop.run_in_executor(
                None,
                self.checkpoint.restore,
                kernel.group or [*_descendants(kernel.pid), kernel.pid],
                need,
            )
        except self.checkpoint.NoRoom as e:
            return None, f"{kernel.server.key} waits to be restored: {e}"
        except Exception as e:
            return False, f"restoring the kernel failed: {e}"
        kernel.checkpoint_bytes, kernel.group = 0, []
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
        ancestors (the Hub) always; else a process whose executable is one of
        ``ArbiterApp.allowed_executables`` (a path, or a bare name of a program in a
        directory only root may write), or whose cgroup lies within one of
        ``allowed_cgroups``. A process gone meanwhile is allowed (nothing to act on)."""
        if pid in self.protected:
            return True
        try:
            exe = os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
        except FileNotFoundError:
            return True
        except OSError:
            exe = ""
        for entry in getattr(self.config, "allowed_executables", ()):
            if exe and (
                exe == entry or ("/" not in entry and os.path.basename(exe) == entry and _root_only(exe))
            ):
                return True
        held = getattr(self.config, "allowed_cgroups", ())
        if held:
            memberships = cgroups.of(pid)
            if memberships is None:
                return True
            for entry in held:
                try:
                    if cgroups.Cgroup.parse_name(entry).holds(memberships):
                        return True
                except ValueError:
                    continue
        return False

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
            self._end(action.pid)
        elif action.kind == "pause" and conn is not None and conn.kernel.state in (books.IDLE,):
            await self._take_off(conn.kernel, "pause", reason=what)

    def _end(self, pid: int) -> None:
        if pid in self.protected:  # never this arbiter or the Hub
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, 9)

    async def _act_unowned(self, action, uuid: str) -> None:
        """Report (log, books, Hub page, metric) and, under ``unowned_policy``, end a
        process that uses a managed card and belongs to no server."""
        entry = self.unowned.get(action.pid)
        if entry is None:
            entry = {"pid": action.pid, "gpu": uuid, "since": time.time(), **_describe(action.pid)}
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
                    await self._take_off(kernel, action, reason="idle")
