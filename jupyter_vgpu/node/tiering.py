"""Host memory and disk, driven: the arbiter's trims, spills and room in host memory.

:mod:`.tiers` says, from the books alone, what the node holds and whom to trim or spill;
this module acts on it. It owns the disk tier (:class:`.disk.DiskTier`, made at start
where its root is safe) and why it is off or left alone (``disk_problem``), asks idle
kernels to let go of their warm pinned slabs (``trim``; paused ones too, once per pause,
when the host itself is short) and paused kernels to move their
data to the disk tier (``spill``), makes room in host memory before a pause
(:meth:`Tiering.host_room`), and in the background spills what is over the mark, tells
every kernel the node's figures and sweeps the disk tier of kernels that ended.

A kernel's word is a figure: what it says it holds on disk is capped by what its
directory holds, a spill it says it made while it holds as much host memory as before is
a failed one, and a disk error it reports is checked against the arbiter's own write
before the disk tier is left alone for everyone (:data:`DISK_BACKOFF_SECONDS`).
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import time
from typing import TYPE_CHECKING

from jupyter_vgpu import failpoints
from jupyter_vgpu.host import procs
from jupyter_vgpu.host.meminfo import meminfo
from jupyter_vgpu.units import format_bytes

from . import books, disk, safe_dirs, tiers
from .books import IDLE, PAUSED, TIERS, Kernel
from .enforcement import REFUSAL_SECONDS

if TYPE_CHECKING:
    from .arbiter import Arbiter
    from .sessions import Connection

log = logging.getLogger("jupyter_vgpu.node")

#: Seconds between two sweeps of the disk tier for directories of kernels that ended.
SWEEP_SECONDS = 5.0
#: Seconds the disk tier is left alone after a spill failed (a full or failing disk).
DISK_BACKOFF_SECONDS = 30.0


def _disk_error(message: str) -> bool:
    """True when a kernel's refusal to spill names an error of the file system (``OSError``
    and its kinds, ``SpillError``), not of the kernel (suspended, not paused)."""
    name = message.split(":", 1)[0].strip()
    kind = getattr(builtins, name, None)
    return name == "SpillError" or (isinstance(kind, type) and issubclass(kind, OSError))


class Tiering:
    """The node's host memory and disk tier, for the arbiter's kernels.

    Args:
        arbiter: the :class:`~.arbiter.Arbiter` (its kernels, settings, decisions).
    """

    def __init__(self, arbiter: Arbiter):
        self.arbiter = arbiter
        self.disk_root: str = getattr(arbiter.config, "disk_dir", "") or ""
        self.disk: disk.DiskTier | None = None  # the disk tier, once its root is made (open)
        self.disk_problem: str | None = None  # why the disk tier failed last, while it is left alone
        self._disk_retry = 0.0  # monotonic seconds after which the disk tier is tried again
        self._swept = 0.0
        self._spilling: asyncio.Task | None = None
        self._spills: dict[int, asyncio.Future] = {}  # kernel pid -> its spill in progress

    async def open(self) -> None:
        """Make the disk tier's root (:class:`.disk.DiskTier`) and sweep it of kernels that
        ended; where it is not safe, the disk tier stays off and ``disk_problem`` says why."""
        if not self.disk_root:
            return
        loop = asyncio.get_running_loop()
        try:
            self.disk = await loop.run_in_executor(None, disk.DiskTier, self.disk_root)
        except OSError as e:
            self.disk_problem = f"the disk tier is off: {e}"
            log.error("%s", self.disk_problem)
        else:
            for gone in await loop.run_in_executor(None, self.disk.sweep):
                self.arbiter.decide("disk tier freed", message=f"{gone}: its kernel has ended")

    def close(self) -> None:
        """Let go of the disk tier's root (the arbiter stops)."""
        if self.disk is not None:
            self.disk.close()
            self.disk = None

    def host_budget(self) -> tiers.HostBudget:
        """The node's host budget for paused kernels, from the settings and ``/proc/meminfo``."""
        config = self.arbiter.config
        total = meminfo().get("MemTotal", 0)
        limit = getattr(config, "host_memory_limit", None)
        if limit is None:
            limit = int(total * getattr(config, "host_memory_fraction", 0.5))
        reserve = getattr(config, "host_reserve", None)
        if reserve is None:
            reserve = max(2**30, total // 20)
        spill_at = int(limit * getattr(config, "host_spill_fraction", 0.8))
        return tiers.HostBudget(limit, spill_at, reserve)

    def _shared(self) -> tiers.Sharing:
        """The node's shared pieces as its accounting needs them
        (:meth:`.shared_pieces.SharedPieces.accounting`)."""
        saving, with_others = self.arbiter.pieces.store.accounting()
        return tiers.Sharing(saving, {pid: n for (pid, _), n in with_others.items()})

    def node_figures(self) -> dict:
        """The node's tiers now: ``host_used`` (host bytes of paused and suspended kernels),
        ``host_limit``, ``host_available`` (``MemAvailable``), ``disk_used`` (bytes in the
        disk tier), ``disk_free`` (free bytes on its file system, or None), ``disk_dir``,
        ``disk_problem``, and how many kernels are in each tier."""
        kernels = self.arbiter.kernels
        return {
            "host_used": tiers.host_used(kernels, self._shared()),
            "host_limit": self.host_budget().limit,
            "host_available": meminfo().get("MemAvailable", 0),
            "disk_used": tiers.disk_used(kernels),
            "disk_free": self.disk.free_bytes() if self.disk is not None else None,
            "disk_dir": self.disk_root or None,
            "disk_problem": self.disk_problem,
            "tiers": {t: sum(1 for k in kernels if k.tier == t) for t in TIERS},
        }

    def disk_dir_of(self, conn: Connection) -> str | None:
        """The disk tier directory of the kernel on ``conn`` (made at its first spill)."""
        if self.disk is None or conn.identity is None:
            return None
        return self.disk.kernel_dir(conn.uid, conn.pid, conn.identity.start)

    def forget(self, uid: int, pid: int, start: int) -> None:
        """Remove the disk tier directory of the kernel that was process ``pid`` of user
        ``uid``, started at ``start`` (clock ticks after boot), once it ended (in the
        background)."""
        if self.disk is not None:
            loop = asyncio.get_running_loop()
            self.arbiter.spawn(loop.run_in_executor(None, self.disk.remove, uid, pid, start))

    def disk_usable(self, need: int) -> str | None:
        """Why ``need`` more bytes cannot go to the disk tier now (None: they can)."""
        if self.disk is None:
            if self.disk_root:
                return self.disk_problem or f"the disk tier {self.disk_root} is not in use"
            return "there is no disk tier (ArbiterApp.disk_dir is empty)"
        if time.monotonic() < self._disk_retry:
            return self.disk_problem or "the disk tier failed a moment ago"
        limit = getattr(self.arbiter.config, "disk_limit", None)
        used = tiers.disk_used(self.arbiter.kernels)
        if limit is not None and used + need > limit:
            return f"the disk tier holds {format_bytes(used)} of its {format_bytes(limit)} limit"
        free = self.disk.free_bytes()
        keep = getattr(self.arbiter.config, "disk_reserve", 2**30) or 0
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

    def _back_off(self, problem: str) -> None:
        self.disk_problem = problem
        self._disk_retry = time.monotonic() + DISK_BACKOFF_SECONDS

    async def _spill(self, kernel: Kernel, tell=None) -> bool:
        a = self.arbiter
        conn = a.conns.get(kernel.pid)
        if conn is None or conn.kernel is not kernel or kernel.state != PAUSED or kernel.host_bytes <= 0:
            return False
        if kernel.moving is not None:  # its suspend is under way: it cannot move its memory meanwhile
            return False
        why = self.disk_usable(kernel.host_bytes)
        if why is None and not kernel.disk_dir:
            why = "the kernel has no directory in the disk tier"
        if why is not None:
            a.decide("spill skipped", server=kernel.server.key, pid=kernel.pid, message=why)
            return False
        loop = asyncio.get_running_loop()
        try:  # the user's directory, theirs and private
            await loop.run_in_executor(None, self.disk.user_dir, kernel.uid)
        except safe_dirs.UnsafePath as e:  # that user's directory alone: their spills wait
            kernel.refused["spill"] = time.monotonic()
            a.decide("spill skipped", server=kernel.server.key, pid=kernel.pid, message=str(e))
            return False
        except OSError as e:
            self._back_off(f"the disk tier's directory cannot be made: {e}")
            a.decide("spill skipped", server=kernel.server.key, pid=kernel.pid, message=self.disk_problem)
            return False
        if tell is not None:
            await tell(
                f"moving {kernel.server.key}'s paused memory ({format_bytes(kernel.host_bytes)}) to disk"
            )
        with kernel.move("spill"):  # no suspend of it meanwhile (:meth:`.moves.Moves.take_off`)
            return await self._spill_asked(conn, kernel)

    async def _spill_asked(self, conn, kernel: Kernel) -> bool:
        """:meth:`spill`'s question to the kernel, and what its answer means."""
        a = self.arbiter
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        held = kernel.host_bytes
        answer = await conn.ask(
            {"type": "spill", "dir": kernel.disk_dir},
            a.config.pause_timeout,
            sent=lambda: failpoints.hit("arbiter.spill"),
        )
        if not answer.get("ok") and a.conns.get(kernel.pid) is not conn:
            a.decide("spill cut short", server=kernel.server.key, pid=kernel.pid, message="the kernel left")
            return False
        a.enforcement.heard(kernel, "spill", answer)
        if not answer.get("ok"):
            a.metrics.spill_failures.inc()
            message = answer.get("message", "")
            # a full or failing disk (the arbiter's own write fails too) leaves the disk tier
            # alone a while; a kernel's own trouble, or its word alone, stops only its spills
            broken = await loop.run_in_executor(None, self.disk.probe) if _disk_error(message) else None
            if broken is not None:
                self._back_off(f"spilling {kernel.server.key} failed: {message} (the disk tier: {broken})")
            a.decide("spill failed", server=kernel.server.key, pid=kernel.pid, message=message)
            return False
        await self._measure(kernel)
        if kernel.host_bytes >= held:  # it said it spilled, and holds as much as before
            kernel.refused["spill"] = time.monotonic()
            why = "the kernel said it moved its memory to disk, yet holds as much host memory as before"
            a.decide("spill failed", server=kernel.server.key, pid=kernel.pid, message=why)
            return False
        self.disk_problem = None
        a.metrics.spills.inc()
        a.decide(
            "spill", server=kernel.server.key, pid=kernel.pid, seconds=round(time.monotonic() - t0, 3),
            message=f"{format_bytes(held)} of host memory to the disk tier",
        )  # fmt: skip
        return True

    async def _measure(self, kernel: Kernel) -> None:
        """Size ``kernel``'s directory of the disk tier, and hold its figure to it."""
        loop = asyncio.get_running_loop()
        kernel.disk_measured = await loop.run_in_executor(None, self._disk_size, kernel)
        self.arbiter.enforcement.take_figures(kernel, {"disk_bytes": kernel.disk_bytes})

    async def trim(self, kernel: Kernel) -> int:
        """Ask an idle kernel to let go of the pinned slabs it keeps warm for its next pause,
        or a paused one (once per pause: :func:`.tiers.paused_to_trim`) of what its process
        holds for nothing until its next cell (:meth:`.kernel.host_memory.HostMemory.trim`);
        the pinned bytes it said it gave back (0: refused, or none). The decision says what
        the process's resident and anonymous memory did meanwhile, read from ``/proc``
        before the question and after the answer (:func:`.procs.memory`, ``status``
        alone: tens of µs), not what the kernel says."""
        a = self.arbiter
        conn = a.conns.get(kernel.pid)
        warm = kernel.state == IDLE and kernel.host_bytes > 0
        if conn is None or conn.kernel is not kernel or not (warm or kernel.state == PAUSED):
            return 0
        if kernel.moving is not None:  # a pause, suspend or spill of it is under way
            return 0
        if kernel.state == PAUSED:
            kernel.trim_asked = time.monotonic()
        before = procs.memory(kernel.pid, rollup=False)
        with kernel.move("trim"):
            answer = await conn.ask({"type": "trim"}, a.config.pause_timeout)
        after = procs.memory(kernel.pid, rollup=False)
        a.enforcement.heard(kernel, "trim", answer)
        released = answer.get("released")  # its figures came first, in a state message
        released = released if isinstance(released, int) and released > 0 else 0
        if not answer.get("ok") or (warm and not released):
            why = answer.get("message", "")
            a.decide("trim refused", server=kernel.server.key, pid=kernel.pid, message=why)
            return 0
        a.metrics.trimmed.inc(released)
        said = f"{format_bytes(released)} of pinned host memory let go (its next pause pins again)"
        if before is not None and after is not None:
            said += (
                f"; its process's resident memory {format_bytes(before.rss)} -> {format_bytes(after.rss)}"
                f" (anonymous {format_bytes(before.anon)} -> {format_bytes(after.anon)})"
            )
        a.decide("trim", server=kernel.server.key, pid=kernel.pid, message=said)
        return released

    def host_step(
        self, victim: Kernel, need: int, asked: list[Kernel] = (), tried: list[Kernel] = ()
    ) -> tuple[str, Kernel | None, str | None]:
        """What :meth:`host_room` does next for ``need`` bytes of ``victim``'s pause (or of
        its suspend, a paused victim), decided from the books and ``MemAvailable`` now and
        changing nothing: ``("fits", None, None)``; ``("trim", kernel, why)`` or
        ``("spill", kernel, why)`` (the host is short, ``why``, and that kernel's warm
        slabs or paused data go first; those in ``asked`` and ``tried`` were already; a
        paused victim's own data first where its suspend would keep it out of the disk
        tier's reach, :func:`.tiers.strands`); ``("past budget", None, note)`` (nothing else
        to move: the pause may pass the budget, the victim going to disk next);
        ``("refuse", None, why)``."""
        now = time.monotonic()
        counted = books.cooperative(self.arbiter.kernels, but=victim)
        budget = self.host_budget()
        available = meminfo().get("MemAvailable", 0)
        shared = self._shared()
        first = (  # a suspend that would keep the victim's paused data out of the disk tier's reach
            victim not in tried
            and not victim.declined("spill", now, REFUSAL_SECONDS)
            and tiers.strands(victim, counted, budget, need, available, shared)
            and self.disk_usable(victim.host_bytes) is None
        )
        if first:
            held = format_bytes(tiers.host_used(counted, shared))
            why = (
                f"its paused data goes to disk before its suspend: the host is past its mark ({held} "
                f"held, {format_bytes(available)} available), and a suspended kernel cannot move it there"
            )
            return "spill", victim, why
        over_budget, over_reserve = tiers.host_room(counted, budget, need, available, shared)
        if not over_budget and not over_reserve:
            return "fits", None, None
        held = format_bytes(tiers.host_used(counted, shared))
        why = (
            f"host memory for paused kernels is full ({held} of {format_bytes(budget.limit)} held, "
            f"{format_bytes(available)} available)"
        )
        warm = tiers.trimmable(counted, now, exclude=(victim, *asked))
        if over_reserve:  # the host itself is short: paused kernels' own memory too
            warm += tiers.paused_to_trim(counted, now, exclude=(victim, *asked))
        warm = [k for k in warm if not k.declined("trim", now, REFUSAL_SECONDS)]
        candidates = [
            k
            for k in tiers.spillable(counted, now, exclude=(victim, *tried), shared=shared)
            if not k.declined("spill", now, REFUSAL_SECONDS)
        ]
        spill_first = not self.arbiter.config.trim_before_spill and candidates
        if spill_first and self.disk_usable(candidates[0].host_bytes) is None:
            return "spill", candidates[0], why  # a trim would make the next pause pin again
        if warm:
            return "trim", warm[0], why  # losing no data comes before moving any to disk
        if not candidates:
            disk_why = self.disk_usable(need)
            if not over_reserve and disk_why is None:
                return "past budget", None, f"{why}: nothing else to move to disk; it goes there next"
            disk_why = disk_why or "no other paused kernel holds host memory to move there"
            return "refuse", None, f"{why}, and the disk tier takes nothing now: {disk_why}"
        disk_why = self.disk_usable(candidates[0].host_bytes)
        if disk_why is not None:
            return "refuse", None, f"{why}, and the disk tier takes nothing now: {disk_why}"
        return "spill", candidates[0], why

    def settle(self, victim: Kernel, step: str, why: str | None) -> str | None:
        """What a last step of :meth:`host_step` (``fits``, ``past budget``, ``refuse``)
        means for ``victim``'s pause: None where it goes ahead (past the budget, said as a
        decision), else why not."""
        if step == "past budget":
            self.arbiter.decide("past the host budget", server=victim.server.key, pid=victim.pid, message=why)
            return None
        return why if step == "refuse" else None

    async def host_room(self, victim: Kernel, need: int, tell=None) -> str | None:
        """Trim idle kernels' warm slabs (each asked once), then spill colder paused kernels,
        until ``need`` bytes of ``victim`` fit in host memory; None when they fit, else why
        not. A pause that would eat into the host's reserve
        is never made (the OOM killer would take whole kernels); one that would pass the
        node's budget only when nothing colder is left to spill and the disk tier can take
        the victim next (a kernel larger than the budget on its own). Each step is
        :meth:`host_step`'s.

        What a kernel that declined to spill holds is its own (:func:`.books.cooperative`):
        it counts against no one else's pause, and it is not asked again before
        :data:`.enforcement.REFUSAL_SECONDS`; the host's reserve (``MemAvailable``,
        measured) still counts everyone's memory."""
        asked: list[Kernel] = []  # to trim: one that gave nothing back is not asked again
        tried: list[Kernel] = []  # to spill: each at most once here
        while True:
            step, kernel, why = self.host_step(victim, need, asked, tried)
            if step in ("fits", "past budget", "refuse"):
                return self.settle(victim, step, why)
            if step == "trim":
                asked.append(kernel)
                await self.trim(kernel)
                continue
            tried.append(kernel)
            await self.spill(kernel, tell)  # whatever came of it, the next look says

    async def _spill_coldest(self) -> None:
        """Trim idle kernels' warm slabs (and paused kernels' own memory while the host's
        available memory is under the reserve), then spill the coldest paused kernels, while the
        node is over its spill mark (kernels that declined either are left out: their
        memory is their own, :func:`.books.cooperative`); with ``trim_before_spill`` False,
        spill first and trim what is still over."""
        if self.arbiter.config.trim_before_spill:
            await self._trim_over()
        await self._spill_over()
        if not self.arbiter.config.trim_before_spill:
            await self._trim_over()

    async def _trim_over(self) -> None:
        now = time.monotonic()
        counted = books.cooperative(self.arbiter.kernels)
        available = meminfo().get("MemAvailable", 0)
        for kernel in tiers.to_trim(counted, self.host_budget(), available, now, self._shared()):
            if not kernel.declined("trim", now, REFUSAL_SECONDS):
                await self.trim(kernel)

    async def _spill_over(self) -> None:
        tried: list[Kernel] = []
        while True:
            now = time.monotonic()
            counted = books.cooperative(self.arbiter.kernels)
            todo = [
                k
                for k in tiers.to_spill(
                    counted, self.host_budget(), meminfo().get("MemAvailable", 0), now, self._shared()
                )
                if k not in tried and not k.declined("spill", now, REFUSAL_SECONDS)
            ]
            if not todo or self.disk_usable(todo[0].host_bytes) is not None:
                return
            tried.append(todo[0])
            await self.spill(todo[0])

    async def step(self, now: float) -> None:
        """The host budget's background step: spill what is over the mark, tell the kernels
        the node's figures, publish the gauges, sweep the disk tier of ended kernels
        (``now``: monotonic seconds)."""
        a = self.arbiter
        if self._spilling is None or self._spilling.done():
            self._spilling = asyncio.ensure_future(self._spill_coldest())
        figures = self.node_figures()
        m = a.metrics
        m.host_bytes.set(figures["host_used"])
        m.process_bytes.set(sum(procs.resident_bytes(k.pid) or 0 for k in a.kernels))
        m.host_limit.set(figures["host_limit"])
        m.disk_bytes.set(figures["disk_used"])
        for tier, n in figures["tiers"].items():
            m.kernels.labels(tier=tier).set(n)
        told = (figures["host_used"] >> 20, figures["host_limit"] >> 20, figures["disk_used"] >> 20)
        for conn in list(a.conns.values()):
            if conn.node_sent != told:
                conn.node_sent = told
                msg = {k: figures[k] for k in ("host_used", "host_limit", "disk_used")}
                await a.sessions.send(conn, {"type": "node", **msg})
        if self.disk is not None and now - self._swept >= SWEEP_SECONDS:
            self._swept = now
            loop = asyncio.get_running_loop()
            for path in await loop.run_in_executor(None, self.disk.sweep):
                a.decide("disk tier freed", message=f"{path}: its kernel has ended")
            for kernel in [k for k in a.kernels if k.disk_bytes > 0]:  # what they say, against what is there
                await self._measure(kernel)

    def _disk_size(self, kernel: Kernel) -> int | None:
        """Bytes in ``kernel``'s directory of the disk tier now (None: no disk tier)."""
        if self.disk is None or kernel.identity is None:
            return None
        return self.disk.size(kernel.uid, kernel.pid, kernel.identity.start)
