"""One session per connected client of the arbiter's socket, from accept to hang-up.

Owns what happens on a connection: who the client is (its peer credentials and
:class:`.procs.Identity`, taken as it connected, never what it says), how many
connections a user may hold, the time a client has to say something, paced reading
(:data:`MESSAGES_PER_SECOND`) and bounded writes (:data:`SEND_TIMEOUT`,
:data:`SEND_BUFFER`), every received line checked against the protocol
(:mod:`.protocol`, the ``to-arbiter`` contract) before anything acts on it, the
trusted requests (``register``, ``unregister``, ``books``, ``refresh``), and a kernel's
hello, admission to its server and state reports. Requests for room go to
:mod:`.room`; answers to the arbiter's own requests to the :class:`Connection` that
asked.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING

from jupyter_vgpu import failpoints
from jupyter_vgpu.host import cgroups, procs
from jupyter_vgpu.slice import Slice

from . import protocol
from .books import ACTIVE, PAUSED, SUSPENDED, Kernel, Server

if TYPE_CHECKING:
    from .arbiter import Arbiter

log = logging.getLogger("jupyter_vgpu.node")

#: Seconds a client may take to read what it is sent, and bytes that may wait for it,
#: before it is hung up on.
SEND_TIMEOUT, SEND_BUFFER = 10.0, 4 * 2**20
#: How fast one client may send messages (per second, and in a burst): faster, its own
#: reading waits; the others' does not.
MESSAGES_PER_SECOND, MESSAGE_BURST = 200.0, 2000


class Connection:
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
        #: (id, purpose, bytes, answer to, cell) of the one waiting its turn (bytes: a ``grow``'s,
        #: else 0; answer to: the connection its answers go to, None: this one; cell: for a
        #: cell the user ran, which takes turns)
        self.room_next: tuple[int, str, int, Connection | None, bool] | None = None
        #: a grow channel's kernel connection (``channel``): this connection carries the
        #: requests of that kernel's allocator to grow, and their answers
        self.channel_of: Connection | None = None
        self.ahead_task: asyncio.Task | None = None  # the room made ahead of its next cell
        self.ahead_stop = False  # its cell asked for room itself: the room ahead stops
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


class Sessions:
    """Every client of the arbiter's socket (its :meth:`serve` is the socket's handler).

    Args:
        arbiter: the :class:`~.arbiter.Arbiter` whose books the clients read and feed.
    """

    def __init__(self, arbiter: Arbiter):
        self.arbiter = arbiter
        self.per_uid: collections.Counter[int] = collections.Counter()  # open connections by uid
        self.open: dict[Connection, asyncio.Task] = {}  # every open connection, and its task
        self.closing = False  # the arbiter stops: its hang-ups are no kernel's leaving

    async def send(self, conn: Connection, msg: dict) -> None:
        """Send ``msg`` to ``conn``; a client that hung up or does not read is not waited for."""
        with contextlib.suppress(ConnectionError, RuntimeError):
            await conn.send(msg)

    async def serve(self, reader, writer) -> None:
        """One client, from its connection to its hang-up.

        Who it is comes from the Linux kernel, never from what it says: its peer
        credentials and its :class:`.procs.Identity` (a client whose process has ended
        since it connected, its PID perhaps another process's now, is turned away). A
        user may hold :attr:`ArbiterApp.max_connections_per_user` connections at once
        (root: any number); a client must say something within
        ``ArbiterApp.hello_timeout`` seconds of connecting, then may stay idle for as long
        as it likes. A malformed line is answered with an ``error`` naming what is wrong,
        and the client may go on; a line longer than :data:`.protocol.MAX_LINE` ends the
        connection."""
        a = self.arbiter
        try:
            pid, uid, identity = procs.Identity.of_peer(writer.get_extra_info("socket"))
        except OSError:
            writer.close()
            return
        conn = Connection(reader, writer, pid, uid, trusted=uid in (0, os.geteuid()), identity=identity)
        cap = getattr(a.config, "max_connections_per_user", 128)
        why = None
        if identity is None:
            why = "the process that connected has ended (its PID may name another process now)"
        elif uid != 0 and self.per_uid[uid] >= cap:
            why = (
                f"uid {uid} holds {self.per_uid[uid]} connections to the arbiter already, its limit "
                "(ArbiterApp.max_connections_per_user)"
            )
            a.metrics.refused_connections.inc()
            log.warning("connection refused: %s", why)
        if why is not None:
            await self.send(conn, {"type": "error", "message": f"refused: {why}"})
            writer.close()
            if identity is not None:
                identity.close()
            return
        self.per_uid[uid] += 1
        self.open[conn] = asyncio.current_task()
        first = True
        try:
            while True:
                try:
                    wait = getattr(a.config, "hello_timeout", 10.0) if first else None
                    line = await asyncio.wait_for(reader.readline(), wait)
                except TimeoutError:
                    await self.send(conn, {"type": "error", "message": "nothing said after connecting"})
                    return
                except (asyncio.LimitOverrunError, ValueError):
                    await self.send(conn, {"type": "error", "message": "line too long"})
                    return
                if not line:
                    return
                first = False
                await conn.paced()
                try:
                    msg = protocol.decode(line)
                except protocol.ProtocolError as e:
                    await self.send(conn, {"type": "error", "message": str(e)})
                    continue
                await self.dispatch(conn, msg)
        except ConnectionError:
            pass
        finally:
            self.open.pop(conn, None)
            self.per_uid[uid] -= 1
            if self.per_uid[uid] <= 0:
                del self.per_uid[uid]
            for task in (conn.room_task, conn.ahead_task):
                if task is not None:
                    task.cancel()
            if a.unknown.get(conn.pid, (None,))[0] is conn:
                del a.unknown[conn.pid]
            if conn.kernel is not None and a.conns.get(conn.pid) is conn:
                del a.conns[conn.pid]
                if not self.closing:
                    a.decide("kernel left", server=conn.kernel.server.key, pid=conn.pid)
                a.pieces.release(conn.kernel)  # its references to pieces held once
                if conn.kernel.disk_dir and not identity.current():
                    a.tiering.forget(uid, pid, identity.start)  # it ended: its disk tier goes too
                await a.notify()
            for future in conn.pending.values():
                if not future.done():
                    future.set_result({"ok": False, "message": "the kernel hung up"})
            writer.close()
            identity.close()

    def may_register(self, conn: Connection) -> str | None:
        """Why ``conn`` may not name slices (None: it may)."""
        if self.arbiter.config.registrars == "none":
            return "slices come from the Hub here; nobody registers them over the socket"
        return self.may_read(conn)

    def may_read(self, conn: Connection) -> str | None:
        """Why ``conn`` may not read the books, every user's figures (None: it may)."""
        if not conn.trusted:
            return "only the arbiter's own user (or root) may"
        if self.arbiter.root_of(conn.pid) is not None:
            return "no process of a user's server may"
        return None

    async def dispatch(self, conn: Connection, msg: dict) -> None:
        """Act on one checked message of ``conn``."""
        kind = msg["type"]
        if kind in protocol.TRUSTED:
            why = self.may_read(conn) if kind in ("books", "refresh") else self.may_register(conn)
            if why:
                await self.send(conn, {"type": "error", "message": f"{kind} refused: {why}"})
                return
            await self.trusted(conn, msg)
        elif kind == "hello":
            await self.hello(conn, msg)
        elif kind == "channel":
            await self.channel(conn)
        elif conn.channel_of is not None:
            await self.on_channel(conn, msg)
        elif conn.kernel is None and conn.hello is not None:
            if kind == "state":  # a kernel whose server is not known yet: kept for its admission
                conn.hello = {
                    **conn.hello,
                    **msg,
                    "type": "hello",
                    "idle_seconds": conn.hello.get("idle_seconds", 0),
                }
        elif conn.kernel is None:
            await self.send(conn, {"type": "error", "message": "say hello first"})
        elif kind == "state":
            self.state(conn.kernel, msg)
            await self.arbiter.notify()
        elif kind == "room":
            await self.arbiter.rooms.request(
                conn, msg["id"], msg["for"], msg.get("bytes", 0), cell=bool(msg.get("cell"))
            )
        elif kind == "reply":
            future = conn.pending.get(msg["id"])
            if future is not None and not future.done():
                future.set_result(msg)

    async def channel(self, conn: Connection) -> None:
        """``conn`` asks to be its kernel's grow channel (protocol version 4): the line of
        the kernel's allocator, which asks for room to grow without a word of Python
        (``vgpu_set_grow_channel``; docs/design.md, "Growth on demand"). Accepted
        (``ok``) only from the process of a connected kernel that is granted growth on
        demand (:meth:`.room.Rooms.on_demand`), as the socket's peer credentials and the
        process's identity show, never from what it says; else an ``error`` and the
        connection ends."""
        kernel_conn = self.arbiter.conns.get(conn.pid)
        why = None
        if conn.kernel is not None or conn.hello is not None or conn.channel_of is not None:
            why = "this connection is a kernel's or a channel already"
        elif kernel_conn is None or kernel_conn.kernel is None:
            why = "no kernel of this process is connected"
        elif conn.identity is None or getattr(kernel_conn.identity, "start", None) != conn.identity.start:
            why = "this process is not the kernel's that connected"
        elif not self.arbiter.rooms.on_demand(kernel_conn):
            why = "this node grants cells their whole budget: there is nothing to ask for"
        if why is not None:
            await self.send(conn, {"type": "error", "message": f"channel refused: {why}"})
            conn.writer.close()
            return
        conn.channel_of = kernel_conn
        await self.send(conn, {"type": "ok"})

    async def on_channel(self, conn: Connection, msg: dict) -> None:
        """A message on a grow channel: ``room`` ``for: grow`` is its kernel's request to
        grow, answered here (:meth:`.room.Rooms.request`); nothing else is said there."""
        kernel_conn = conn.channel_of
        if msg["type"] != "room" or msg["for"] != "grow":
            await self.send(conn, {"type": "error", "message": "a grow channel carries room for: grow alone"})
        elif self.arbiter.conns.get(conn.pid) is not kernel_conn:
            why = "this kernel's connection to the arbiter is gone"
            await self.send(conn, {"type": "deny", "id": msg["id"], "message": why})
        else:
            nbytes = msg.get("bytes", 0)
            await self.arbiter.rooms.request(kernel_conn, msg["id"], "grow", nbytes, answer_to=conn)

    async def trusted(self, conn: Connection, msg: dict) -> None:
        """A trusted client's request (``register``, ``unregister``, ``refresh``, ``books``),
        once :meth:`may_register` or :meth:`may_read` allowed it."""
        a = self.arbiter
        kind = msg["type"]
        if kind == "register":
            try:
                slice_ = Slice.from_dict(msg["slice"])
                where = cgroups.Cgroup.parse_name(msg["cgroup"]) if msg.get("cgroup") else None
            except ValueError as e:  # a SliceError, or not a cgroup's name
                await self.send(conn, {"type": "error", "message": f"register: {e}"})
                return
            cgroup, hierarchy = (where.path, where.hierarchy) if where else (None, cgroups.V2)
            server = a.register(
                msg["pid"], msg["user"], msg["server"], slice_, cgroup=cgroup, cgroup_hierarchy=hierarchy,
                start=msg.get("start"), uid=msg.get("uid"),
            )  # fmt: skip
            if a.journal is not None:
                a.journal.add(msg["pid"], msg["user"], msg["server"], slice_, server.start, server.uid)
            await self.send(conn, {"type": "ok"})
        elif kind == "unregister":
            a.unregister(msg["pid"])
            if a.journal is not None:
                a.journal.remove(msg["pid"])
            await self.send(conn, {"type": "ok"})
        elif kind == "refresh":
            if a.refresh_servers is not None:
                await a.refresh_servers()
            await self.send(conn, {"type": "ok"})
        else:
            await self.send(conn, {"type": "ok", "books": a.snapshot()})

    async def hello(self, conn: Connection, msg: dict) -> None:
        """A kernel says who it is and, from version 2 on, where its memory is: a kernel
        that reconnects after a restart brings its state back into the books."""
        a = self.arbiter
        failpoints.hit("arbiter.hello")
        conn.hello = msg
        server = a.server_of(conn.pid)
        if server is None and a.refresh_servers is not None:
            await a.refresh()
            server = a.server_of(conn.pid)
        if server is None:
            a.unknown[conn.pid] = (conn, msg["kernel_id"])
            await self.send(conn, {"type": "welcome", "slice": None, "server": None, "disk_dir": None})
            return
        await self.admit(conn, server, msg["kernel_id"])

    @staticmethod
    def inadmissible(conn: Connection, server: Server) -> str | None:
        """Why the process on ``conn`` may not be ``server``'s kernel (None: it may): it
        must still be the process that connected (its PID was read to find its server),
        and of the server's account where the Hub names one."""
        if conn.identity is None or not conn.identity.current():
            return "the process that connected has ended (its PID may name another process now)"
        if server.uid is not None and conn.uid != server.uid:
            return f"this process runs as uid {conn.uid}, not as {server.key}'s account (uid {server.uid})"
        return None

    async def admit(self, conn: Connection, server: Server, kernel_id: str) -> None:
        """Make the process on ``conn`` a kernel of ``server`` in the books, with the figures
        of its hello (capped: :meth:`.enforcement.Enforcement.take_figures`), and welcome
        it; or refuse it (:meth:`inadmissible`) and hang up."""
        a = self.arbiter
        why = self.inadmissible(conn, server)
        if why is not None:
            a.metrics.refused_peers.inc()
            a.decide("kernel refused", server=server.key, pid=conn.pid, uid=conn.uid, message=why)
            await self.send(conn, {"type": "error", "message": f"refused: {why}"})
            conn.writer.close()
            return
        old = a.conns.get(conn.pid)
        if old is not None and old is not conn:
            old.writer.close()  # the same process again (it reconnected), or one that ended
        kernel = Kernel(conn.pid, server, kernel_id, uid=conn.uid, identity=conn.identity)
        hello = conn.hello or {}
        if hello.get("version", 1) >= 2:
            kernel.state = hello["state"]
            kernel.since = time.monotonic() - hello["idle_seconds"]
            a.enforcement.take_figures(kernel, hello)
            if not kernel.slice.simulated:
                kernel.resident = 0  # NVML's, at the next look
            if kernel.state == ACTIVE:  # it runs a cell now: it keeps the room it had
                kernel.granted = kernel.budget
            if kernel.state == SUSPENDED:
                kernel.checkpoint_bytes = min(hello["resident"], kernel.slice.gpu_memory or kernel.budget)
        kernel.disk_dir = a.tiering.disk_dir_of(conn)
        conn.kernel = kernel
        a.conns[conn.pid] = conn
        a.decide("kernel joined", server=server.key, pid=conn.pid, state=kernel.state, tier=kernel.tier)
        a.metrics.joined.labels(tier=kernel.tier).inc()
        welcome = {"type": "welcome", "slice": server.slice.to_dict(), "server": server.key}
        welcome["disk_dir"] = kernel.disk_dir
        if self.arbiter.rooms.on_demand(conn):  # of version 4: only to kernels that know it
            welcome["grow"] = True
        await self.send(conn, welcome)
        if kernel.state == SUSPENDED:
            a.spawn(a.moves.found_suspended(kernel))
        elif kernel.state == PAUSED and a.config.even_contexts and a.checkpoint is not None:
            a.spawn(a.moves.found_paused(kernel))
        await a.notify()

    def state(self, kernel: Kernel, msg: dict) -> None:
        """A kernel's report of its state and figures (capped, as at its hello)."""
        a = self.arbiter
        before = kernel.tier
        if msg["state"] != kernel.state:
            was, held = kernel.state, kernel.holding()  # the hold read before the change
            if was == ACTIVE:  # its code ended: was it a cell it did not call one?
                a.turns.left_active(kernel)
            kernel.state, kernel.since = msg["state"], time.monotonic()
            kernel.refused.clear()  # asked again, it may answer otherwise now
            if kernel.state != ACTIVE:
                kernel.granted = kernel.asks = 0
            kernel.hold_after(was, held, a.config.room_held_seconds)
            if kernel.state == SUSPENDED:
                # a suspended kernel reports what the checkpoint took off the card (NVML's
                # figure before it) as resident: the books' figure may already be 0
                said = min(msg["resident"], kernel.slice.gpu_memory or kernel.budget)
                kernel.checkpoint_bytes = max(kernel.resident, said)
        kernel.pausable = None  # said anew with each state, or not known
        a.enforcement.take_figures(kernel, {"disk_bytes": 0, **msg})
        if msg["resume_seconds"] is not None:
            tier = {"disk": "disk", "suspended": "suspend"}.get(before, "pause")
            a.metrics.resume_seconds.labels(gpu=kernel.slice.gpu_uuid, tier=tier).observe(
                msg["resume_seconds"]
            )

    async def close_all(self, timeout: float = 5.0) -> None:
        """Hang up on every client (the arbiter stops; kernels reconnect to the next one),
        and wait, at most ``timeout`` seconds, for each connection's task to end as at any
        hang-up: one left to the closing loop wrote "Task was destroyed but it is
        pending!" and a traceback, those of clients that had not said hello among them."""
        self.closing = True
        for conn in self.open:
            conn.writer.close()
        if self.open:
            await asyncio.wait(list(self.open.values()), timeout=timeout)
