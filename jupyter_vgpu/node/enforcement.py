"""Enforcement: budgets held from outside the kernels, and no kernel's word believed past its bounds.

Owns the watchdog's side effects (:class:`.watchdog.Watchdog` is pure: a reading in,
actions out): which cards it looks at, who may use a managed card without a server
(:func:`.allowlist.judge`), the processes on the cards as identities
(:class:`.procs.Identity`, kept from one look to the next while they are the same
process), and what is done about a server over its budget or on the wrong GPU: a
notice to its kernels, a pause of an idle kernel, or a kill through the process's pidfd,
never of this arbiter or the Hub, never of a process of another account than its
server's. Processes of no server are reported (the books, the Hub's page, a metric)
and, under ``unowned_policy``, ended.

It also holds what a kernel says to account (:meth:`Enforcement.take_figures`: figures
capped by the slice and by what was measured, :data:`FIGURE_SLACK`) and remembers its
refusals and silences (:meth:`Enforcement.heard`: :data:`REFUSAL_SECONDS`,
:data:`UNRESPONSIVE_SECONDS`), so that no kernel's word costs anyone else.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import TYPE_CHECKING

from jupyter_vgpu.host import peers, procs
from jupyter_vgpu.nvml import NVMLUnavailable
from jupyter_vgpu.units import format_bytes

from . import allowlist
from .books import IDLE, Kernel, Reason
from .watchdog import Watchdog, owners

if TYPE_CHECKING:
    from .arbiter import Arbiter

log = logging.getLogger("jupyter_vgpu.node")

#: Seconds a kernel that let a request go unanswered is not asked again (its memory stays
#: where it is meanwhile, as any kernel that cannot be paused), unless it answers sooner.
UNRESPONSIVE_SECONDS = 600.0
#: Seconds a kernel's refusal (to pause, suspend, spill or trim) stands, unless its state
#: changes sooner: asking again would get the same answer.
REFUSAL_SECONDS = 60.0
#: Bytes past its budget a kernel's host and disk figures may reach (chunk headers,
#: checksums) before the books stop believing them.
FIGURE_SLACK = 64 * 2**20


class Enforcement:
    """The watchdog's actions and the bounds on what kernels say, for one arbiter.

    Args:
        arbiter: the :class:`~.arbiter.Arbiter` (its servers, kernels, settings).
    """

    def __init__(self, arbiter: Arbiter):
        self.arbiter = arbiter
        config = arbiter.config
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
        self._seen: dict[int, procs.Identity] = {}  # processes on the managed cards at the last look

    # -- what a kernel says ------------------------------------------------------------

    def take_figures(self, kernel: Kernel, msg: dict) -> None:
        """Take the byte figures of a kernel's hello or state (those ``msg`` holds) into
        the books, never past what its slice allows nor past what the arbiter measured:
        paused bytes at most its budget, or what NVML showed it holding just before its
        pause (:attr:`.books.Kernel.measured`); host and disk bytes at most its budget
        plus :data:`FIGURE_SLACK`, disk bytes at most what its directory of the disk tier
        holds (:attr:`.books.Kernel.disk_measured`); a simulated card's resident bytes at
        most the card. A figure past its bound is logged once, and the bound is used. Its
        cached free bytes (``cached_bytes``) are taken as said, 0 where left out: a release
        is chosen by them, but what it made is read from NVML (:func:`.books.releasable`)."""
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
                self.arbiter.decide(
                    "figure capped", server=kernel.server.key, pid=kernel.pid,
                    message=f"it says {key} {format_bytes(value)}; the books hold {format_bytes(bound)}",
                )  # fmt: skip
            setattr(kernel, key, min(value, bound))
        if "pausable_bytes" in msg:  # an estimate's figure: a kernel's word lowers only its own bound
            kernel.pausable = min(msg["pausable_bytes"], budget)
        # a figure for choosing a release (version 5), bounded where it is used by what NVML
        # shows the kernel holding; left out (not known, or paused): nothing to release
        if msg.get("type") in ("hello", "state"):
            kernel.cached = msg.get("cached_bytes", 0)

    def heard(self, kernel: Kernel, action: str, answer: dict) -> None:
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
            self.arbiter.decide(
                "kernel unresponsive", server=kernel.server.key, pid=kernel.pid,
                message=f"no answer to {action}: not asked again for {UNRESPONSIVE_SECONDS:.0f} s",
            )  # fmt: skip

    # -- the watchdog ------------------------------------------------------------------

    async def managed_cards(self) -> set[str]:
        """The real cards whose processes the watchdog looks at: those of the registered
        slices, and ``ArbiterApp.managed_gpus`` (by default every GPU, or MIG instance,
        NVML lists on this host; read once)."""
        cards_now = {
            u for s in self.arbiter.servers.values() if not s.slice.simulated for u in s.slice.gpu_uuids
        }
        if self._managed is None:
            self._managed = await asyncio.get_running_loop().run_in_executor(None, self._list_managed)
        return cards_now | self._managed

    def _list_managed(self) -> set[str]:
        wanted = list(getattr(self.arbiter.config, "managed_gpus", None) or ["all"])
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
        config = self.arbiter.config
        ok, why = allowlist.judge(
            pid, getattr(config, "allowed_executables", ()), getattr(config, "allowed_cgroups", ())
        )
        if not ok and pid in self.unowned:
            self.unowned[pid]["why"] = why
        return ok

    async def step(self, now: float) -> None:
        """Compare every server's processes on the managed cards, together, with its
        budget, and find the cards' processes that belong to no server (real cards);
        ``now`` is monotonic seconds."""
        a = self.arbiter
        processes: dict[int, int] = {}
        by_card: dict[int, dict[str, int]] = {}
        read: set[str] = set()
        for uuid in sorted(await self.managed_cards()):
            try:
                reading = await a.read(uuid)
            except NVMLUnavailable:  # a.read noted it: a decision and a log line once, not every look
                continue
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
        owner = owners(a.servers.values(), a.mapping, read)
        actions = self.watchdog.step(now, processes, owner, self.allowed, by_card)
        self.unowned = {
            pid: entry for pid, entry in self.unowned.items() if pid in processes and owner(pid) is None
        }
        for action in actions:
            await self._act(action, self._card_of.get(action.pid, ""))
        for uuid in {self._card_of.get(pid, "") for pid in self.unowned} | set(self._unowned_cards):
            a.metrics.unowned.labels(gpu=uuid).set(
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
        a = self.arbiter
        if action.unowned:
            await self._act_unowned(action, uuid)
            return
        what = "wrong GPU" if action.wrong_gpu else "over budget"
        a.decide(
            f"{what}: {action.kind}", server=action.server, pid=action.pid, used=action.used,
            total=action.total, budget=action.budget, mapped_by=action.mapped_by, message=action.message(),
            **({"gpus": [uuid for uuid, _ in action.elsewhere]} if action.wrong_gpu else {}),
        )  # fmt: skip
        a.metrics.enforcement.labels(gpu=uuid, action=action.kind).inc()
        kernel_pid = peers.root_in(action.pid, a.conns)  # the kernel it runs under, if any
        conn = a.conns.get(kernel_pid) if kernel_pid is not None else None
        key = a.root_of(action.pid)
        for other in a.conns.values():  # every kernel of the server hears of it
            if other.kernel is not None and other.kernel.server.root == key:
                await a.sessions.send(other, {"type": "notice", "message": action.message()})
        if action.kind == "kill":
            server = a.server_of(action.pid)
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
                a.decide("not ended", server=action.server, pid=action.pid, message=why)
            else:
                self._end(action.pid)
        elif action.kind == "pause" and conn is not None and conn.kernel.state in (IDLE,):
            reason = Reason.WRONG_GPU if action.wrong_gpu else Reason.OVER_BUDGET
            await a.moves.take_off(conn.kernel, "pause", reason)

    def _end(self, pid: int) -> None:
        """SIGKILL to the process ``pid`` was when the watchdog last looked (through its
        identity: never to a process that took its PID since), never this arbiter or the Hub."""
        ident = self._seen.get(pid)
        if pid in self.protected or ident is None:
            return
        if not ident.send(signal.SIGKILL):
            self.arbiter.decide(
                "not ended", pid=pid, message="it ended, or its PID names another process now"
            )

    async def _act_unowned(self, action, uuid: str) -> None:
        """Report (log, books, Hub page, metric) and, under ``unowned_policy``, end a
        process that uses a managed card and belongs to no server."""
        entry = self.unowned.get(action.pid)
        if entry is None:
            entry = {"pid": action.pid, "gpu": uuid, "since": time.time(), **procs.describe(action.pid)}
            self.unowned[action.pid] = entry
        entry["used"] = action.used
        self.arbiter.decide(
            f"unowned: {action.kind}", gpu=uuid, pid=action.pid, used=action.used, mapped_by="unowned",
            message=f"{action.message()}: {entry['exe'] or '?'}, uid {entry['uid']}, "
            f"cgroup {entry['cgroup'] or '?'}",
        )  # fmt: skip
        self.arbiter.metrics.unowned_actions.labels(gpu=uuid, action=action.kind).inc()
        if action.kind == "kill":
            self._end(action.pid)
