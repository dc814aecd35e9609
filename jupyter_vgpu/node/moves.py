"""Kernels off their card and back: pauses asked of kernels, suspends and restores through the driver.

Owns every move of a kernel's memory across the card's edge that the arbiter decides:
a pause (the kernel moves its memory to host memory and answers), a suspend (the kernel
prepares, then the driver's process checkpoint takes the kernel and its children that
hold memory on the card), a restore from that checkpoint, a paused kernel's context
taken through the checkpoint and straight back (:meth:`Moves.even`), and the look at a
kernel met suspended at its hello. Host memory for a pause is made first (:mod:`.tiering`);
the card's memory is then read until NVML shows it free.

Every call of the driver's checkpoint goes through :meth:`Moves.driver` (bounded by
:mod:`.checkpoint_pool`; the books show it while it lasts), and only on processes
checked just before to be still the ones taken (:func:`checked`): a PID that changed
hands is never handed to the driver.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING

from jupyter_vgpu import failpoints
from jupyter_vgpu.host import peers, procs

from . import cards, protocol, tiers
from .books import PAUSED, SUSPENDED, Kernel, Reason

if TYPE_CHECKING:
    from .arbiter import Arbiter

log = logging.getLogger("jupyter_vgpu.node")


def _descendants(pid: int, uid: int) -> list[int]:
    """Every process of user ``uid`` descending from ``pid`` (from ``/proc``): the processes
    a kernel may have been suspended with, when the arbiter that suspended it is not this
    one. Another user's process below it (a setuid program) is never among them."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    return [p for p in pids if p != pid and pid in peers.ancestors(p) and procs.uid_of(p) == uid]


class ProcessChanged(RuntimeError):
    """A process the arbiter was about to act on has ended, or its PID names another
    process now; nothing was done."""


def checked(identities: list[procs.Identity]) -> list[int]:
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


class Moves:
    """Pauses, suspends and restores of the arbiter's kernels.

    Args:
        arbiter: the :class:`~.arbiter.Arbiter` (its connections, the driver's checkpoint
            module in ``checkpoint``, or None where the driver lacks it).
    """

    def __init__(self, arbiter: Arbiter):
        self.arbiter = arbiter

    async def take_off(
        self,
        kernel: Kernel,
        action: str,
        reason: Reason,
        for_whom: str = "",
        tell=None,
        notes=None,
        host_first: list[tuple[Kernel, int]] | None = None,
        claimed: bool = False,
    ) -> bool:
        """Pause (or pause, then suspend) ``kernel``; True when its memory left the card.
        Host memory for it is made first (:meth:`.tiering.Tiering.host_room`); where none
        can be, it stays. A paused kernel's suspend, the host past its mark, first moves
        its paused data to disk (:func:`.tiers.strands`: suspended, it could not).
        ``reason`` labels the pauses metric and the decision. With ``host_first`` (a
        caller holding its card's lock), host memory that needs a trim or a spill first
        is not made here: ``(kernel, bytes)`` is added to it, the kernel
        stays for now, and the caller makes that room once it has let go of the lock (a
        spill of gigabytes must hold up no other kernel's room on the card). That is
        decided on one look at the host (:meth:`.tiering.Tiering.host_step`), acted on as
        it is: a second look could find the host shorter and start a spill under the lock.

        A kernel that cannot be paused safely (it says why: a thread that may use the GPU
        while idle, child processes on the GPU...) is suspended instead, where the
        driver's checkpoint is available; one the driver cannot suspend (CUDA IPC, managed
        memory) pauses in part, what is shared or managed staying on the card, and refuses
        a suspend later. A suspend takes the kernel's child processes that hold memory on
        the card with it.

        ``claimed``: the caller marked the kernel ``moving`` already (under its card's lock,
        for a move it makes once it has let go of the lock: :meth:`.room.Rooms._take_ahead`);
        the mark goes whatever comes of the move. A kernel with another move under way
        stays.
        """
        try:
            return await self._take_off(kernel, action, reason, for_whom, tell, notes, host_first, claimed)
        finally:
            if claimed:
                kernel.moving = None

    async def _take_off(
        self,
        kernel: Kernel,
        action: str,
        reason: Reason,
        for_whom: str,
        tell,
        notes,
        host_first,
        claimed: bool,
    ) -> bool:
        a = self.arbiter
        conn = a.conns.get(kernel.pid)
        if conn is None or self._moving(kernel, claimed, notes):
            return False
        need = tiers.host_need(kernel)
        if host_first is not None:  # one look, acted on: no trim or spill under the card's lock
            step, _, why = a.tiering.host_step(kernel, need)
            if step in ("trim", "spill"):  # the caller makes that host room, outside its card's lock
                host_first.append((kernel, need))
                if notes is not None:
                    notes.append(f"{kernel.server.key} waits for host memory: {why}")
                return False
            why = a.tiering.settle(kernel, step, why)
        else:
            why = await a.tiering.host_room(kernel, need, tell)
        if why is not None:
            a.decide(f"{action} skipped", server=kernel.server.key, pid=kernel.pid, message=why)
            if notes is not None:
                notes.append(f"{kernel.server.key} stays: {why}")
            return False
        if self._moving(kernel, claimed, notes):  # one began while host memory was made
            return False
        with kernel.move(action):
            return await self._move(conn, kernel, action, reason, for_whom, notes)

    @staticmethod
    def _moving(kernel: Kernel, claimed: bool, notes: list[str] | None) -> bool:
        """Whether another move of ``kernel`` is under way (``claimed``: the caller's own);
        ``notes`` hears why it stays. A spill or trim of it, say: a suspend would freeze the
        kernel midway through it, and whatever waits for that move would wait for its
        restore (a spill took 80 s; 48 MLP sessions, seed 7 at 777869e,
        ``benchmarks/results/sessions-h100.json``)."""
        if kernel.moving is None or claimed:
            return False
        if notes is not None:
            notes.append(f"{kernel.server.key} stays: its {kernel.moving} is under way")
        return True

    async def _move(
        self, conn, kernel: Kernel, action: str, reason: Reason, for_whom: str, notes: list[str] | None
    ) -> bool:
        """:meth:`take_off` once host memory is made for it: the kernel asked, the driver
        called, the books and the decision written."""
        a = self.arbiter
        uuid = kernel.slice.gpu_uuid
        t0 = time.monotonic()
        reading = await a.read(uuid)  # before the move: what settles it is read against it
        if action == "pause" and not kernel.slice.simulated:
            # NVML's, just read: the bound of the paused bytes it reports, in the state
            # message it sends while pausing (before its answer), not a figure of its last pause
            kernel.measured = kernel.resident
            kernel.peak_on_cards = dict(kernel.on_cards)
        answer = await conn.ask(
            {"type": action}, a.config.pause_timeout, sent=lambda: failpoints.hit("arbiter.pause")
        )
        a.enforcement.heard(kernel, action, answer)
        if (
            not answer.get("ok")
            and action == "pause"
            and a.checkpoint is not None
            and not answer.get("timeout")
        ):
            a.decide("pause refused", server=kernel.server.key, message=answer.get("message", ""))
            action = kernel.moving = "suspend"
            answer = await conn.ask({"type": action}, a.config.pause_timeout)
            a.enforcement.heard(kernel, action, answer)
        if not answer.get("ok"):
            a.decide(f"{action} refused", server=kernel.server.key, message=answer.get("message", ""))
            if notes is not None:
                notes.append(f"{kernel.server.key} stays: {answer.get('message', '')}")
            return False
        if action == "suspend":
            failpoints.hit("arbiter.suspend")
            group = self.group_of(kernel, reading.processes)
            # what the checkpoint takes off the card, after the kernel's own pause: its restore needs it back
            await self._footprint(kernel, group)
            try:
                await self.driver(
                    kernel,
                    "suspend",
                    lambda: a.checkpoint.suspend(checked(group), nbytes=kernel.checkpoint_bytes),
                )
            except Exception as e:
                procs.close_quietly(group[:-1])
                a.decide("suspend failed", server=kernel.server.key, message=str(e))
                return False
            kernel.group, kernel.group_ids = [i.pid for i in group], group
            kernel.state, kernel.since = SUSPENDED, time.monotonic()
            a.metrics.suspends.labels(gpu=uuid).inc()
        else:
            kernel.state = PAUSED
            a.metrics.pauses.labels(gpu=uuid, reason=reason.value).inc()
        released = answer.get("released")  # bytes; absent from a suspend's answer
        if released != 0:  # a pause that released nothing leaves nothing to wait for
            await self.settle(uuid, reading, kernel.group if action == "suspend" else [kernel.pid])
        took = time.monotonic() - t0
        fields = {"released": released} if released is not None else {}
        if action == "suspend" and len(kernel.group) > 1:
            fields["with"] = ",".join(map(str, kernel.group[:-1]))
        said = f"{reason.value} for {for_whom}" if reason in (Reason.ROOM, Reason.AHEAD) else reason.value
        a.decide(
            action, server=kernel.server.key, pid=kernel.pid, reason=said, seconds=round(took, 3), **fields
        )
        return True

    async def release(
        self, kernel: Kernel, for_whom: str, notes: list[str] | None = None, reason: Reason = Reason.ROOM
    ) -> int:
        """Ask idle ``kernel`` to give back the free blocks its allocator keeps cached on
        its card (``release``, protocol version 5; :attr:`.books.Kernel.cached`), for
        ``for_whom``'s room (``reason``: a cell's, or the room ahead of a prefetched
        cell, :data:`.books.Reason.AHEAD`): nothing is stored and it stays on the card,
        idle. Returns the bytes it says it gave back, a figure only (0: refused,
        unanswered, nothing to give, or a kernel of an older version, which is not asked);
        where that is not 0, NVML is read until it shows them free (:meth:`settle`), and
        the room is decided on NVML's figures alone. Its cached figure is set to 0 whatever
        it answers, until it says anew (its state message after the release): a kernel
        that said more than it gave is not asked twice for the same room. ``notes`` hears
        why it gave nothing."""
        a = self.arbiter
        conn = a.conns.get(kernel.pid)
        if conn is None or (conn.hello or {}).get("version", 1) < protocol.RELEASE_VERSION:
            return 0  # an older kernel knows no release
        if self._moving(kernel, False, notes):
            return 0
        uuid = kernel.slice.gpu_uuid
        with kernel.move("release"):
            t0 = time.monotonic()
            reading = await a.read(uuid)
            kernel.cached = 0
            answer = await conn.ask({"type": "release"}, a.config.pause_timeout)
            a.enforcement.heard(kernel, "release", answer)
            if not answer.get("ok"):
                a.decide("release refused", server=kernel.server.key, message=answer.get("message", ""))
                if notes is not None:
                    notes.append(f"{kernel.server.key} kept its cached memory: {answer.get('message', '')}")
                return 0
            released = answer.get("released") or 0
            if released:
                await self.settle(uuid, reading, [kernel.pid])
            a.metrics.releases.labels(gpu=uuid).inc()
            a.decide(
                "release", server=kernel.server.key, pid=kernel.pid, reason=f"{reason.value} for {for_whom}",
                seconds=round(time.monotonic() - t0, 3), released=released,
            )  # fmt: skip
            return released

    async def _footprint(
        self, kernel: Kernel, group: list[procs.Identity], read: dict[str, cards.Reading] | None = None
    ) -> None:
        """Set ``kernel``'s ``checkpoint_need`` (bytes per card of its slice) and
        ``checkpoint_bytes`` to what ``group`` holds on its cards now (NVML; ``read``: cards
        the caller has just read, by UUID, not read again): what a checkpoint of them takes
        off the cards, and their restore needs back."""
        a = self.arbiter
        kernel.checkpoint_need = {}
        for card in kernel.slice.gpu_uuids:
            reading = (read or {}).get(card) or await a.read(card)
            kernel.checkpoint_need[card] = sum(reading.processes.get(i.pid, 0) for i in group)
        kernel.checkpoint_bytes = sum(kernel.checkpoint_need.values())

    async def even(self, kernel: Kernel) -> bool:
        """Take paused ``kernel``'s processes that hold memory on its cards (its group, as a
        suspend takes it: :meth:`group_of`) through the driver's checkpoint and straight
        back, the kernel neither asked nor told: while they are locked the driver holds
        their CUDA calls. Their contexts are then of the kind the driver restored, which
        the driver's time-slicing favours about 3:1 over one that never left its card
        (``ArbiterApp.even_contexts``; docs/design.md, the eleventh and twelfth tries).
        The caller marked it ``moving`` ``even`` (under its card's lock: no other move
        of it begins, a cell of it waits, and :func:`.books.promised` keeps what the
        checkpoint takes for its restore); the mark goes whatever comes of it.

        Both driver calls are made on one thread, in one go: a restore never waits on the
        event loop, nor is left undone by a task cancelled as the arbiter stops. A
        restore the card has no room for, or that the driver refuses, leaves the kernel
        suspended in the books, with its group and footprint, for its next cell to
        restore as any suspended kernel's, and so does a call given up past its deadline
        (the driver may hold it locked or checkpointed: that restore unlocks or restores
        it, and leaves one still running as it is); a checkpoint the driver refuses leaves
        it as it was, and it is not tried again for a minute (``refused``).

        Returns:
            True when its context came back restored.
        """
        a = self.arbiter
        try:
            return await self._even(kernel)
        finally:
            kernel.moving = None
            await a.notify()

    async def _even(self, kernel: Kernel) -> bool:
        a = self.arbiter
        key = kernel.server.key
        reading = await a.read(kernel.slice.gpu_uuid)
        group = self.group_of(kernel, reading.processes)
        await self._footprint(kernel, group, {kernel.slice.gpu_uuid: reading})
        state: dict[str, object] = {}
        evens = a.metrics.evens

        def cycle() -> float:
            t0 = time.monotonic()
            a.checkpoint.suspend(checked(group), nbytes=kernel.checkpoint_bytes)
            state["checkpointed"] = True
            a.checkpoint.restore(checked(group), kernel.checkpoint_need)
            return time.monotonic() - t0

        try:
            seconds = await self.driver(kernel, "even", cycle)
        except Exception as e:
            given_up = isinstance(e, getattr(a.checkpoint, "Timeout", ()))
            if not state and not given_up:  # the checkpoint refused: every process is as it was
                procs.close_quietly(group[:-1])
                kernel.checkpoint_bytes, kernel.checkpoint_need = 0, {}
                kernel.refused["even"] = time.monotonic()
                a.decide("even refused", server=key, pid=kernel.pid, message=str(e))
                evens.labels(gpu=kernel.slice.gpu_uuid, outcome="refused").inc()
                return False
            kernel.group, kernel.group_ids = [i.pid for i in group], group
            kernel.state, kernel.since = SUSPENDED, time.monotonic()
            a.decide("even: restore waits", server=key, pid=kernel.pid, message=str(e))
            evens.labels(gpu=kernel.slice.gpu_uuid, outcome="restore waits").inc()
            return False
        procs.close_quietly(group[:-1])
        kernel.checkpoint_bytes, kernel.checkpoint_need = 0, {}
        kernel.restored_context = True
        a.decide("evened", server=key, pid=kernel.pid, seconds=round(seconds, 3))
        evens.labels(gpu=kernel.slice.gpu_uuid, outcome="evened").inc()
        return True

    def group_of(self, kernel: Kernel, on_card) -> list[procs.Identity]:
        """The processes a suspend of ``kernel`` takes, the kernel last: its descendants
        holding memory on the card (``on_card``: PIDs) that are of its uid and its server,
        each as a :class:`.procs.Identity` taken now."""
        group = []
        for pid in on_card:
            if pid == kernel.pid or kernel.pid not in peers.ancestors(pid):
                continue
            ident = procs.Identity.of(pid, uid=kernel.uid)
            if ident is not None and self.arbiter.root_of(pid) == kernel.server.root:
                group.append(ident)
            elif ident is not None:
                ident.close()
        return [*group, kernel.identity]

    async def driver(self, kernel: Kernel, what: str, call):
        """``call()`` (a call of the driver's checkpoint about ``kernel``, each bounded by
        the :mod:`.checkpoint_pool`) in the executor. While it lasts, the books show it
        (``driver_call``: which call, since when); one given up past its deadline is a
        decision, and the kernel hears of it (``%vgpu status`` shows the notice).

        Raises:
            Exception: whatever ``call`` raised.
        """
        a = self.arbiter
        kernel.driver_call = (what, time.time())
        try:
            return await asyncio.get_running_loop().run_in_executor(None, call)
        except Exception as e:
            if isinstance(e, getattr(a.checkpoint, "Timeout", ())):
                a.decide("driver call given up", server=kernel.server.key, pid=kernel.pid, message=str(e))
                conn = a.conns.get(kernel.pid)
                if conn is not None:
                    notice = f"{e}. If this kernel does not answer, restart it."
                    await a.sessions.send(conn, {"type": "notice", "message": notice})
            raise
        finally:
            kernel.driver_call = None

    async def settle(self, uuid: str, before: cards.Reading, pids: list[int], timeout: float = 2.0) -> None:
        """Wait (briefly, ``timeout`` seconds) for NVML to show on card ``uuid`` the memory
        that ``pids`` let go of since ``before`` (:func:`.cards.let_go`): the next look at
        the card counts it free."""
        a = self.arbiter
        if a.simulated_total(uuid) is not None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cards.let_go(before, await a.read(uuid), pids):
                return
            await asyncio.sleep(0.02)

    async def restore(self, kernel: Kernel) -> tuple[bool | None, str]:
        """Bring ``kernel`` (and its group) back from the driver's checkpoint, if the driver
        holds it; ``(True, "")`` once it runs (restored now, or it was not checkpointed),
        ``(None, why)`` when NVML shows too little free memory to try (a restore the card
        has no room for leaves the process unrestorable: :mod:`jupyter_vgpu.host.checkpoint`), ``(False,
        why)`` when the driver refused."""
        a = self.arbiter
        if not kernel.group and not kernel.checkpoint_bytes:
            # not suspended by this arbiter, nor with a footprint: only the kernel's word
            # says so (chaos mode's helper, or a kernel suspended before it touched CUDA)
            try:
                where = await self.driver(
                    kernel, "state", lambda: a.checkpoint.state(*checked([kernel.identity]))
                )
            except Exception:  # no CUDA context in it: nothing the driver holds
                where = "running"
            if where == "running":
                return True, ""
        failpoints.hit("arbiter.restore")
        # logged before the driver's call, so that a restore that never ends shows in the log
        log.info("restoring %s from the driver's checkpoint (group %s)", kernel.describe(), kernel.group)
        need = None
        if not kernel.slice.simulated:  # the bytes on each card, as the suspend found them
            need = kernel.checkpoint_need or {kernel.slice.gpu_uuid: kernel.checkpoint_bytes}
        group = kernel.group_ids
        if not group:  # suspended by another: its descendants of its own user, as they are now
            found = [procs.Identity.of(p, uid=kernel.uid) for p in _descendants(kernel.pid, kernel.uid)]
            group = [*(i for i in found if i is not None), kernel.identity]
        try:
            seconds = await self.driver(kernel, "restore", lambda: a.checkpoint.restore(checked(group), need))
        except a.checkpoint.NoRoom as e:
            return None, f"{kernel.server.key} waits to be restored: {e}"
        except Exception as e:
            return False, f"restoring the kernel failed: {e}"
        finally:
            if group is not kernel.group_ids:
                procs.close_quietly(group[:-1])
        procs.close_quietly(kernel.group_ids[:-1])
        kernel.checkpoint_bytes, kernel.group, kernel.group_ids = 0, [], []
        kernel.checkpoint_need = {}
        kernel.restored_context = True
        a.metrics.resume_seconds.labels(gpu=kernel.slice.gpu_uuid, tier="suspend").observe(seconds)
        a.decide("restored", server=kernel.server.key, pid=kernel.pid, seconds=round(seconds, 3))
        return True, ""

    async def found_paused(self, kernel: Kernel) -> None:
        """A kernel that says it is paused, met at its hello on a node that takes contexts
        through the driver (``ArbiterApp.even_contexts``): an arbiter before this one may
        have ended between the checkpoint and the restore of :meth:`even`, which the
        kernel never hears of. The driver is asked; a process it holds is handled as one
        met suspended (:meth:`found_suspended`)."""
        a = self.arbiter
        try:
            where = await self.driver(
                kernel, "state", lambda: a.checkpoint.state(*checked([kernel.identity]))
            )
        except Exception:  # no CUDA context in it: nothing the driver holds
            return
        if where != "running":
            kernel.state = SUSPENDED
            await self.found_suspended(kernel)

    async def found_suspended(self, kernel: Kernel) -> None:
        """A kernel that says it is suspended, met at its hello (its checkpoint's holder,
        an arbiter before this one or chaos mode's helper, may have ended): ask the driver
        where the process is, so that it is never left locked for good. A checkpointed
        process is restored at its next cell, as any suspended kernel; one left locked by a
        suspend cut short holds its memory on the card still, and is unlocked now."""
        a = self.arbiter
        key = kernel.server.key
        if a.checkpoint is None:
            why = "no driver checkpoint here; the kernel restores itself when it runs a cell"
            a.decide("suspended kernel found", server=key, pid=kernel.pid, message=why)
            return
        try:
            where = await self.driver(
                kernel, "state", lambda: a.checkpoint.state(*checked([kernel.identity]))
            )
        except Exception as e:
            why = f"the driver cannot say where it is: {e}"
            a.decide("suspended kernel found", server=key, pid=kernel.pid, message=why)
            return
        if where == "locked":
            try:
                await self.driver(kernel, "unlock", lambda: a.checkpoint.restore(checked([kernel.identity])))
            except Exception as e:
                a.decide("unlock failed", server=key, pid=kernel.pid, message=str(e))
                return
            kernel.state, kernel.checkpoint_bytes = PAUSED, 0
            why = "its suspend was cut short: unlocked, its memory had not left the card"
            a.decide("unlocked", server=key, pid=kernel.pid, message=why)
        elif where == "failed":
            message = "the driver's checkpoint of this kernel failed; its next cell tries to restore it"
            a.decide("checkpoint failed", server=key, pid=kernel.pid, message=message)
            conn = a.conns.get(kernel.pid)
            if conn is not None:
                await a.sessions.send(conn, {"type": "notice", "message": message})
        else:
            why = f"the driver says {where}; restored at its next cell"
            a.decide("suspended kernel found", server=key, pid=kernel.pid, message=why)
