"""The node arbiter: owns the host's cards and makes room for whoever runs a cell.

Kernels connect to its Unix socket (:mod:`.protocol`); the arbiter knows each by its
peer credentials and the registered server whose cgroup it is in (:mod:`jupyter_vgpu.host.cgroups`; a
pod's on Kubernetes), or else whose process tree it descends from (:mod:`jupyter_vgpu.host.peers`),
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

:class:`Arbiter` holds the books (the registered servers, :mod:`.registry`; the
connected kernels; the cards' locks) and the daemon's life (start, stop, the background
step), and hands each kind of work to a collaborator holding a reference to it:

- :mod:`.sessions`: each client's connection, from accept to hang-up, and what it says;
- :mod:`.room`: requests for room, answered by making it;
- :mod:`.moves`: pauses, suspends and restores (the driver's checkpoint);
- :mod:`.tiering`: host memory and the disk tier (trims, spills, room in host memory);
- :mod:`.process_memory`: each kernel process's own host memory, measured from outside;
- :mod:`.enforcement`: the watchdog's actions, and the bounds on what kernels say;
- :mod:`.decisions`: the decision log.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from pathlib import Path

from jupyter_vgpu.host import cgroups, procs
from jupyter_vgpu.nvml import NVMLUnavailable
from jupyter_vgpu.units import format_bytes

from . import books, cards, handoff, mps, namespaces, piece_socket, protocol, safe_dirs, slurm
from .books import PAUSED, SUSPENDED, Kernel, Reason
from .cards import Reading
from .decisions import DecisionLog
from .enforcement import REFUSAL_SECONDS, Enforcement
from .journal import Journal
from .limits import pieces_within
from .metrics import Metrics
from .moves import Moves
from .piece_socket import PieceSocket
from .process_memory import ProcessMemory
from .registry import Registry
from .room import Rooms
from .sessions import Connection, Sessions
from .shared_pieces import SharedPieces
from .tiering import Tiering
from .turns import Turns

__all__ = ["Arbiter"]

log = logging.getLogger("jupyter_vgpu.node")

#: Seconds between two looks at the MPS daemons this arbiter started.
MPS_WATCH_SECONDS = 10.0


class Arbiter(Registry):
    """The books and decisions of one host.

    Args:
        config: the :class:`~.app.ArbiterApp` (its settings: ``suspend_after``,
            ``watermark``, ``queue_timeout``, ``poll_seconds``, ``pause_timeout``).
        checkpoint: the module suspending and restoring processes
            (:mod:`jupyter_vgpu.host.checkpoint`), or None where the driver lacks it.
        pod_of: maps a PID to the uid of its Kubernetes pod, or None
            (:func:`.namespaces.pod_uid`, which reads its cgroup).
        job_of: maps a PID to the id of its Slurm job, or None (:func:`.slurm.job_id`,
            which reads its cgroup).
    """

    def __init__(self, config, checkpoint=None, pod_of=namespaces.pod_uid, job_of=slurm.job_id):
        super().__init__(pod_of, job_of)
        self.config = config
        self.checkpoint = checkpoint
        self.conns: dict[int, Connection] = {}  # kernel pid -> its connection
        self.unknown: dict[int, tuple[Connection, str]] = {}  # pid -> (connection, kernel id): no server yet
        self.metrics = Metrics()
        self.decisions = DecisionLog(config.decisions_kept)
        self.decide = self.decisions.add
        #: Cards that did not answer at the last look, and why (:meth:`card_down`).
        self.cards_down: dict[str, str] = {}
        #: Cards ``ArbiterApp.card_reserve`` leaves no memory of (said once each: :meth:`read`).
        self.cards_reserved_whole: set[str] = set()
        self.locks: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)  # by card
        self._changed: asyncio.Condition | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: list[asyncio.Task] = []
        self._inflight: set[asyncio.Task] = set()
        self._evening: asyncio.Task | None = None  # a context taken through the driver now
        self.mps = mps.MPSDaemons(getattr(config, "socket_path", "") or "/run/jupyter-vgpu/arbiter.sock")
        self._mps_watched = 0.0  # monotonic seconds of the last look at the daemons
        self._mps_asked: set[str] = set()  # GPUs whose daemon was started (or found missing)
        self._mps_limits: dict[str, tuple[int, int]] = {}  # by GPU: the ceiling its daemon took
        self._mps_setting = asyncio.Lock()  # one card's limits set at a time, in order
        self.refresh_servers = None  # async callable re-reading registrations (the Hub link)
        self._refreshing: asyncio.Future | None = None
        self.journal: Journal | None = None  # registrations over the socket (standalone)
        self._lock_fd: int | None = None
        self.started = time.monotonic()
        self.sessions = Sessions(self)
        self.turns = Turns(self)
        self.rooms = Rooms(self)
        self.moves = Moves(self)
        self.tiering = Tiering(self)
        self.process_memory = ProcessMemory(self)
        self.enforcement = Enforcement(self)
        self.pieces = PieceSocket(self, SharedPieces(getattr(config, "share_pieces", "all"), pieces_within()))

    # -- the books -------------------------------------------------------------------

    @property
    def kernels(self) -> list[Kernel]:
        """Every admitted kernel, connected now."""
        return [c.kernel for c in self.conns.values() if c.kernel is not None]

    def on_card(self, uuid: str) -> list[Kernel]:
        """The kernels whose slice is on card ``uuid`` (a slice of several cards is on each)."""
        return [k for k in self.kernels if uuid in k.slice.gpu_uuids]

    def simulated_total(self, uuid: str) -> int | None:
        """The bytes of card ``uuid`` when it is simulated (no NVML behind it), else None."""
        for server in self.servers.values():
            if uuid in server.slice.gpu_uuids:
                return server.slice.card_memory(uuid) if server.slice.simulated else None
        return None

    async def read(self, uuid: str) -> Reading:
        """The card now; on a real card every kernel's ``resident`` is updated from NVML.
        Whether the card answered is noted (:meth:`card_down`).

        Raises:
            jupyter_vgpu.nvml.NVMLUnavailable: the card does not answer (:func:`.cards.read`).
        """
        kernels = self.on_card(uuid)
        reported = {k.pid: k.resident for k in kernels}
        total = self.simulated_total(uuid)
        index = next((k.slice.gpu_index for k in kernels), None)
        loop = asyncio.get_running_loop()
        try:
            reserve = getattr(self.config, "card_reserve", 0) or 0
            reading = await loop.run_in_executor(None, cards.read, uuid, total, reported, index, reserve)
        except NVMLUnavailable as e:
            self.card_down(uuid, str(e))
            raise
        self.card_down(uuid, None)
        if reserve and reading.total == 0 and uuid not in self.cards_reserved_whole:
            self.cards_reserved_whole.add(uuid)  # an admin's setting: said once, as the card is first read
            self.decide(
                "card reserved whole", gpu=uuid,
                message=f"ArbiterApp.card_reserve ({format_bytes(reserve)}) is as large as the card: "
                "the arbiter counts none of it as room, and a cell that needs memory there waits in vain",
            )  # fmt: skip
            log.warning("GPU %s: ArbiterApp.card_reserve leaves nothing of it to share", uuid)
        if total is None:
            for k in kernels:  # this card's bytes, and the sum over the slice's cards
                k.on_cards[uuid] = reading.processes.get(k.pid, 0)
                k.resident = sum(k.on_cards.values())
                if k.state not in (PAUSED, SUSPENDED):  # the most it held since its last pause began
                    k.measured = max(k.measured or 0, k.resident)
                    k.peak_on_cards[uuid] = max(k.peak_on_cards.get(uuid, 0), k.on_cards[uuid])
        return reading

    def card_down(self, uuid: str, why: str | None) -> None:
        """Note whether card ``uuid`` answers (``why``: None) or not (why not); a change
        is a decision (``card unreadable``, ``card back``) and a log line, once."""
        if why == self.cards_down.get(uuid):
            return
        if why is None:
            del self.cards_down[uuid]
            self.decide("card back", gpu=uuid, message="the card answers NVML again")
        else:
            self.cards_down[uuid] = why
            self.decide("card unreadable", gpu=uuid, message=why)

    def node_figures(self) -> dict:
        """The node's tiers now (:meth:`.tiering.Tiering.node_figures`)."""
        return self.tiering.node_figures()

    def shared_figures(self) -> dict:
        """The pieces held once (:meth:`.shared_pieces.SharedPieces.figures`), each
        holder's share by PID: ``{"scope", "pieces", "held_bytes", "referenced_bytes",
        "by_pid": {pid: bytes}}`` (``scope``: ``ArbiterApp.share_pieces``)."""
        f = self.pieces.store.figures()
        by_holder = f.pop("by_holder")
        by_pid = {str(pid): v for (pid, _), v in by_holder.items()}
        return {"scope": self.pieces.store.scope, **f, "by_pid": by_pid}

    def allowed(self, pid: int) -> bool:
        """Whether a process of no server may use a managed card
        (:meth:`.enforcement.Enforcement.allowed`)."""
        return self.enforcement.allowed(pid)

    async def enforce(self, now: float) -> None:
        """The watchdog's look at the managed cards (:meth:`.enforcement.Enforcement.step`;
        ``now``: monotonic seconds)."""
        await self.enforcement.step(now)

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
                    "pausable_bytes": k.pausable,  # what it says its pause would store (None: not said)
                    "cached_bytes": k.cached,  # what it says a release would give back (0: not said)
                    "process_bytes": procs.resident_bytes(k.pid),
                    "process_private_bytes": procs.private_bytes(k.pid),
                    # RSS, PSS, anonymous, shared: read in the background (process_memory)
                    "process": ProcessMemory.figures(k, now),
                    "tier": k.tier,
                    "budget": k.budget,
                    "gpu_uuid": k.slice.gpu_uuid,
                    # a call of the driver's checkpoint about it in progress: which, since when
                    "driver_call": {"call": k.driver_call[0], "since": k.driver_call[1]}
                    if k.driver_call
                    else None,
                    # its move under way (pause, suspend, spill, trim, even: one at a time), or None
                    "moving": k.moving,
                    # its CUDA context is one the driver restored (ArbiterApp.even_contexts)
                    "restored_context": k.restored_context,
                    # bytes a granted prefetch holds for its next cell now (0: none)
                    "room_held": k.holding(now),
                    # its requests take turns whatever they say (it ran code past turn_wait unnamed a cell)
                    "turns_kept": k.turns_kept,
                }
                for k in self.kernels
            ],
            "unknown": sorted(self.unknown),
            "shared_pieces": self.shared_figures(),
            "node": self.node_figures(),
            "decisions": list(self.decisions),
            "unowned": sorted(self.enforcement.unowned.values(), key=lambda u: u["pid"]),
        }

    # -- MPS daemons -----------------------------------------------------------------

    def mps_for(self, slice_, start: bool = True) -> None:
        """Start the MPS control daemon of an ``mps`` slice's card, once per card, and
        keep its limits the card's ceiling (:func:`.mps.ceiling`) as slices come and go
        (in the background; real cards only, where ``ArbiterApp.mps_daemons`` allows).
        ``start`` False (a slice gone): the ceiling only, of a daemon already running."""
        if slice_.isolation != "mps" or slice_.simulated or not getattr(self.config, "mps_daemons", True):
            return
        if start and slice_.gpu_uuid not in self._mps_asked:
            self._mps_asked.add(slice_.gpu_uuid)
            self.spawn(self._start_mps(slice_.gpu_uuid))
        elif slice_.gpu_uuid in self.mps.started and self._mps_ceiling(slice_.gpu_uuid) not in (
            None,
            self._mps_limits.get(slice_.gpu_uuid),
        ):  # the Hub registers every server again every few seconds: a task only for a change
            self.spawn(self._limit_mps(slice_.gpu_uuid))

    def _mps_ceiling(self, uuid: str) -> tuple[int, int] | None:
        """The ceiling of the ``mps`` slices registered on GPU ``uuid`` now (:func:`.mps.ceiling`)."""
        return mps.ceiling((s.slice for s in self.servers.values()), uuid)

    async def _start_mps(self, uuid: str) -> None:
        """Start (or find) the MPS control daemon of GPU ``uuid`` and give it the card's
        ceiling; the outcome is a decision."""
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.mps.ensure, uuid)
            self.decide("mps daemon", gpu=uuid, message="running")
        except mps.MPSUnavailable as e:
            self.decide("mps unavailable", gpu=uuid, message=str(e))
            return
        self._mps_limits.pop(uuid, None)  # a daemon started anew has its own defaults
        await self._limit_mps(uuid)

    async def _limit_mps(self, uuid: str) -> None:
        """Give GPU ``uuid``'s daemon the ceiling of the ``mps`` slices registered on it
        now, where that changed (:meth:`.mps.MPSDaemons.set_limits`); the outcome is a
        decision. A card whose slices are all gone keeps its last ceiling."""
        async with self._mps_setting:
            limits = self._mps_ceiling(uuid)
            if limits is None or self._mps_limits.get(uuid) == limits:
                return
            percent, budget = limits
            try:
                read = await asyncio.get_running_loop().run_in_executor(
                    None, self.mps.set_limits, uuid, percent, budget
                )
            except mps.MPSUnavailable as e:
                self.decide("mps limits refused", gpu=uuid, message=str(e))
                return
            self._mps_limits[uuid] = limits
            self.decide(
                "mps limits",
                gpu=uuid,
                message=f"every client of this card at most {percent}% of its SMs and {format_bytes(budget)} "
                f"(the largest share and budget of its mps slices; the daemon read back {read})",
            )

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
                self.decide("mps daemon gone", gpu=uuid, message="restarting it")
                await self._start_mps(uuid)

    # -- tasks and changes -----------------------------------------------------------

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

    def spawn(self, coro) -> asyncio.Task:
        """Run ``coro`` as a task the arbiter keeps a reference to until it ends; returns it."""
        task = asyncio.ensure_future(coro)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return task

    async def notify(self) -> None:
        """Wake every request for room that waits for the books to change."""
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()

    async def wait_for_change(self, timeout: float) -> None:
        """Wait until :meth:`notify` is called, or ``timeout`` seconds pass."""
        if self._changed is None:  # an arbiter driven without :meth:`start` (its own tests)
            self._changed = asyncio.Condition()
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)

    # -- life ------------------------------------------------------------------------

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
        await self.tiering.open()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._changed = asyncio.Condition()
        self._server = await asyncio.start_unix_server(
            self.sessions.serve, str(path), limit=protocol.MAX_LINE
        )
        os.chmod(path, 0o666)  # anyone may connect; who they are comes from the kernel
        if self.pieces.store.scope != "off":
            self.pieces.start(path.parent / piece_socket.NAME)
        self._tasks.append(asyncio.ensure_future(self._background()))
        log.info("listening on %s", path)

    async def stop(self) -> None:
        """Stop listening and hang up on every client (kernels reconnect to the next arbiter).
        A context being taken through the driver (:meth:`.moves.Moves.even`) is let come
        back first (its driver calls are bounded by the checkpoint pool's deadlines): its
        kernel, never told of it, would otherwise wait for a next arbiter to find it."""
        if self._evening is not None and not self._evening.done():
            await asyncio.wait([self._evening], timeout=60)
        for task in [*self._tasks, *self._inflight]:
            task.cancel()
        if self._server is not None:
            self._server.close()
        await self.sessions.close_all()
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the next arbiter may take over
            self._lock_fd = None
        self.tiering.close()
        self.pieces.close()

    async def refresh(self) -> None:
        """Read the registrations again (the Hub's slices); callers at the same time share
        one read (twenty kernels reconnecting after a restart make one request)."""
        if self.refresh_servers is None:
            return
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self.refresh_servers())
        await asyncio.shield(self._refreshing)

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
        code, pause idle kernels on full cards and suspend long-idle ones. The moves are
        decided under each card's lock, their kernels marked ``moving`` there, and made
        once it is let go (:meth:`_background_moves`): a cell that starts meanwhile is
        decided at once. Made under the lock, 33 of 1,157 cells of the 48-session runs on
        file started during such a move and waited for it, up to 1.1 s (a pause that
        pinned its host memory again; ``benchmarks/results/sessions-h100.json``)."""
        now = time.monotonic()
        await self.enforcement.step(now)
        await self._watch_mps(now)
        await self.tiering.step(now)
        self.process_memory.step(now)
        host_first: list[tuple[Kernel, int]] = []  # pauses that wait for host memory, made below
        evening: Kernel | None = None  # a paused kernel whose context goes through the driver next
        decided: list[tuple[str, list]] = []  # each card's moves, made outside its lock
        for uuid in {u for k in self.kernels for u in k.slice.gpu_uuids}:
            if self.locks[uuid].locked():
                continue  # a room request is deciding on this card
            async with self.locks[uuid]:
                kernels = self.on_card(uuid)
                if not books.quiet(kernels):
                    continue  # a cell runs on this card: background work waits (books.quiet)
                try:
                    reading = await self.read(uuid)
                except NVMLUnavailable:
                    continue  # the other cards' work goes on (read noted why)
                todo = books.ahead_of_time(
                    kernels, reading.used, reading.total, self.config.watermark, now, uuid
                )
                if self.checkpoint is not None and self.config.suspend_after > 0:
                    todo += [
                        (k, "suspend")
                        for k in kernels
                        if k.state == PAUSED and k.idle_for(now) >= self.config.suspend_after
                    ]
                todo = [(k, action) for k, action in todo if k.moving is None]
                for kernel, action in todo:  # theirs: no room or other move takes them meanwhile
                    kernel.moving = action
                if todo:
                    decided.append((uuid, todo))
                if evening is None:
                    evening = self._to_even(kernels, reading, now)
        for uuid, todo in decided:  # outside the cards' locks
            await self._background_moves(uuid, todo, host_first)
        for kernel, need in host_first:  # outside the cards' locks: no room request waits for it
            await self.tiering.host_room(kernel, need)
        if evening is not None:  # marked under its card's lock; the driver's calls outside it
            self._evening = self.spawn(self.moves.even(evening))

    async def _background_moves(self, uuid: str, todo: list, host_first: list) -> None:
        """Make the background moves ``todo`` (``[(kernel, action)]``, marked ``moving``
        under card ``uuid``'s lock, now let go) one after another while the card stays
        quiet; the rest, once a cell starts there, are left for the next quiet look, their
        marks taken off (so are those of moves a fault kept from being made), and a room
        request waiting for them to leave is woken (:meth:`notify`)."""
        left = list(todo)
        try:
            while left and books.quiet(self.on_card(uuid)):  # a cell started: the rest waits
                kernel, action = left.pop(0)
                await self.moves.take_off(kernel, action, Reason.IDLE, host_first=host_first, claimed=True)
        finally:
            for kernel, _ in left:
                kernel.moving = None
            if left:
                await self.notify()

    def _to_even(self, kernels: list[Kernel], reading: Reading, now: float) -> Kernel | None:
        """With ``ArbiterApp.even_contexts``, the paused kernel of ``kernels`` (one card's,
        its lock held, ``reading`` just taken) whose context the driver is to take off
        the card and straight back next (:meth:`.moves.Moves.even`), marked ``moving``
        ``even``; None: none, or one is under way on the node already (one at a time:
        each locks its processes for a second or so). Left as they are: a kernel on a
        slice of several cards, one holding no context on the card (it never used CUDA),
        one the driver refused within the last minute, and one whose checkpoint the
        host's budget could not hold now (:meth:`.tiering.Tiering.host_step`)."""
        if not self.config.even_contexts or self.checkpoint is None:
            return None
        if self._evening is not None and not self._evening.done():
            return None
        for k in sorted(kernels, key=lambda k: -k.idle_for(now)):
            if (
                k.state != PAUSED
                or k.restored_context
                or k.moving is not None
                or k.slice.simulated
                or len(k.slice.gpu_uuids) > 1
                or reading.processes.get(k.pid, 0) == 0
                or k.declined("even", now, REFUSAL_SECONDS)
            ):
                continue
            if self.tiering.host_step(k, reading.processes[k.pid])[0] != "fits":
                continue
            k.moving = books.EVEN
            return k
        return None
