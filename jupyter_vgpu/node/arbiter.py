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

All of it runs on one asyncio loop; NVML readings and the driver's checkpoint calls
run in a thread pool so the loop never waits on the driver.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from pathlib import Path

from jupyter_vgpu.slice import Slice, SliceError
from jupyter_vgpu.units import format_bytes

from . import books, cards, cgroups, mps, namespaces, peers, protocol, slurm
from .books import ACTIVE, PAUSED, SUSPENDED, Kernel, Server
from .cards import Reading
from .metrics import Metrics
from .watchdog import Watchdog, owners

log = logging.getLogger("jupyter_vgpu.node")


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


class _Conn:
    """One connected client."""

    def __init__(self, reader, writer, pid: int, uid: int, trusted: bool):
        self.reader, self.writer = reader, writer
        self.pid, self.uid, self.trusted = pid, uid, trusted
        self.kernel: Kernel | None = None
        self.pending: dict[int, asyncio.Future] = {}
        self.next_id = 1

    async def send(self, msg: dict) -> None:
        self.writer.write(protocol.encode(msg))
        await self.writer.drain()

    async def ask(self, msg: dict, timeout: float) -> dict:
        """Send a request and wait for its reply (``{"ok": False}`` on timeout or hang-up)."""
        rid = self.next_id
        self.next_id += 1
        future = asyncio.get_running_loop().create_future()
        self.pending[rid] = future
        try:
            await self.send({**msg, "id": rid})
            return await asyncio.wait_for(future, timeout)
        except (TimeoutError, ConnectionError):
            return {"ok": False, "message": f"no answer within {timeout:.0f} s"}
        finally:
            self.pending.pop(rid, None)


#: Seconds between two looks at the MPS daemons this arbiter started.
MPS_WATCH_SECONDS = 10.0


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
                    "budget": k.budget,
                    "gpu_uuid": k.slice.gpu_uuid,
                }
                for k in self.kernels
            ],
            "decisions": list(self.decisions),
            "unowned": sorted(self.unowned.values(), key=lambda u: u["pid"]),
        }

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
        """Listen on ``path`` (its directory is made, owned by us, writable by us alone)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o755)
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
        elif conn.kernel is None:
            await self._send(conn, {"type": "error", "message": "say hello first"})
        elif kind == "state":
            self._state(conn.kernel, msg)
            await self._notify()
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
            await self._send(conn, {"type": "ok"})
        elif kind == "unregister":
            for key in [k for k, s in self.servers.items() if s.pid == msg["pid"] and not s.pod_uid]:
                del self.servers[key]
            await self._send(conn, {"type": "ok"})
        elif kind == "refresh":
            if self.refresh_servers is not None:
                await self.refresh_servers()
            await self._send(conn, {"type": "ok"})
        else:
            await self._send(conn, {"type": "ok", "books": self.snapshot()})

    async def _hello(self, conn: _Conn, msg: dict) -> None:
        server = self.server_of(conn.pid)
        if server is None and self.refresh_servers is not None:
            await self.refresh_servers()
            server = self.server_of(conn.pid)
        if server is None:
            self.unknown[conn.pid] = (conn, msg["kernel_id"])
            await self._send(conn, {"type": "welcome", "slice": None, "server": None})
            return
        await self._admit(conn, server, msg["kernel_id"])

    async def _admit(self, conn: _Conn, server: Server, kernel_id: str) -> None:
        old = self.conns.get(conn.pid)
        if old is not None and old is not conn:
            old.writer.close()
        conn.kernel = Kernel(conn.pid, server, kernel_id)
        self.conns[conn.pid] = conn
        self._decide("kernel joined", server=server.key, pid=conn.pid)
        await self._send(conn, {"type": "welcome", "slice": server.slice.to_dict(), "server": server.key})

    def _state(self, kernel: Kernel, msg: dict) -> None:
        if msg["state"] != kernel.state:
            kernel.state, kernel.since = msg["state"], time.monotonic()
            if kernel.state != ACTIVE:
                kernel.granted = 0
        if kernel.slice.simulated:  # no counters: the kernel's figure is all there is
            kernel.resident = msg["resident"]
        kernel.paused_bytes, kernel.host_bytes = msg["paused_bytes"], msg["host_bytes"]
        if msg["resume_seconds"] is not None:
            self.metrics.resume_seconds.labels(gpu=kernel.slice.gpu_uuid, tier="pause").observe(
                msg["resume_seconds"]
            )

    # -- room ------------------------------------------------------------------------

    async def _room(self, conn: _Conn, rid: int, purpose: str) -> None:
        kernel = conn.kernel
        uuid = kernel.slice.gpu_uuid
        t0 = time.monotonic()
        deadline = t0 + self.config.queue_timeout
        told = False
        while True:
            async with self._locks[uuid]:
                short, reading = await self._make_room(kernel, uuid)
                if short <= 0:
                    if purpose == "restore" and kernel.state == SUSPENDED:
                        ok, why = await self._restore(kernel)
                        if not ok:
                            await self._send(conn, {"type": "deny", "id": rid, "message": why})
                            return
                    others = [k for k in self.on_card(uuid) if k is not kernel]
                    kernel.granted = books.growth(kernel, reading.free, others)
                    kernel.state, kernel.since = ACTIVE, time.monotonic()
                    waited = time.monotonic() - t0
                    self.metrics.queue_wait.labels(gpu=uuid).observe(waited)
                    await self._send(conn, {"type": "grant", "id": rid})
                    return
            running = [k for k in self.on_card(uuid) if k.state == ACTIVE and k is not kernel]
            message = (
                f"waiting for GPU memory on GPU {kernel.slice.gpu_index}: {len(running)} session(s) running, "
                f"{format_bytes(short + reading.free)} needed, {format_bytes(reading.free)} free"
            )
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
                await self._send(conn, {"type": "wait", "id": rid, "message": message})
                told = True
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), 1.0)

    async def _make_room(self, kernel: Kernel, uuid: str) -> tuple[int, Reading]:
        """Pause or suspend idle kernels until ``kernel`` fits; returns what is still short."""
        reading = await self.read(uuid)
        others = [k for k in self.on_card(uuid) if k is not kernel]
        short = books.shortfall(kernel, reading.free, others)
        if short <= 0:
            return short, reading
        for victim, action in books.victims(others, kernel, self.config.suspend_after):
            if action == "suspend" and self.checkpoint is None:
                continue
            ok = await self._take_off(victim, action, reason=f"room for {kernel.server.key}")
            if not ok:
                continue
            reading = await self.read(uuid)
            short = books.shortfall(kernel, reading.free, [k for k in self.on_card(uuid) if k is not kernel])
            if short <= 0:
                break
        return short, reading

    async def _take_off(self, kernel: Kernel, action: str, reason: str) -> bool:
        """Pause (or pause, then suspend) ``kernel``; True when its memory left the card.

        A kernel that cannot be paused safely (it says why: a thread that may use the GPU
        while idle, memory shared through CUDA IPC, child processes on the GPU...) is
        suspended instead, where the driver's checkpoint is available. A suspend takes
        the kernel's child processes that hold memory on the card with it.
        """
        conn = self.conns.get(kernel.pid)
        if conn is None:
            return False
        uuid = kernel.slice.gpu_uuid
        t0 = time.monotonic()
        reading = await self.read(uuid)
        before = reading.used
        answer = await conn.ask({"type": action}, self.config.pause_timeout)
        if not answer.get("ok") and action == "pause" and self.checkpoint is not None:
            self._decide("pause refused", server=kernel.server.key, message=answer.get("message", ""))
            action = "suspend"
            answer = await conn.ask({"type": action}, self.config.pause_timeout)
        if not answer.get("ok"):
            self._decide(f"{action} refused", server=kernel.server.key, message=answer.get("message", ""))
            return False
        if action == "suspend":
            group = [p for p in reading.processes if p != kernel.pid and kernel.pid in peers.ancestors(p)]
            group.append(kernel.pid)
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

    async def _restore(self, kernel: Kernel) -> tuple[bool, str]:
        try:
            seconds = await asyncio.get_running_loop().run_in_executor(
                None, self.checkpoint.restore, kernel.group or [kernel.pid]
            )
        except Exception as e:
            return False, f"restoring the kernel failed: {e}"
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
        self._card_of = {}
        for uuid in sorted(await self.managed_cards()):
            try:
                reading = await self.read(uuid)
            except Exception as e:
                log.warning("cannot read GPU %s: %s", uuid, e)
                continue
            for pid, used in reading.processes.items():
                processes[pid] = processes.get(pid, 0) + used
                if used >= processes[pid] - used:
                    self._card_of[pid] = uuid
        owner = owners(self.servers.values(), self.mapping)
        actions = self.watchdog.step(now, processes, owner, self.allowed)
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
        self._decide(
            f"over budget: {action.kind}", server=action.server, pid=action.pid, used=action.used,
            total=action.total, budget=action.budget, mapped_by=action.mapped_by, message=action.message(),
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
            await self._take_off(conn.kernel, "pause", reason="over budget")

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
