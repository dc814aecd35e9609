"""The arbiter's books: every card, server and kernel of the host, and whom to pause for whom.

Pure bookkeeping, no I/O: :mod:`.arbiter` feeds it what kernels report and what NVML
measures, and asks it two questions. :func:`shortfall`: how many bytes must be freed on
a card before a kernel may run (its budget, capped at what the card could ever give it,
less what it already holds, against the card's free memory and the growth other
running kernels are entitled to).
:func:`victims`: which idle kernels to pause or suspend for it, in the order the design
map gives (see DESIGN.md, "Room on demand"): kernels eligible for suspension first
(idle longer than ``suspend_after`` and already paused), then the longest idle, the
lowest priority, and the most above their guaranteed request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import time
from typing import TYPE_CHECKING

from jupyter_vgpu.slice import Slice

if TYPE_CHECKING:
    from jupyter_vgpu.host import procs


class Reason(str, enum.Enum):
    """Why a kernel is taken off its card: the label of the pauses metric and the start of
    the decision's ``reason``."""

    ROOM = "room"  # another kernel asked for room (the decision names whom for)
    AHEAD = "room ahead"  # a prefetch: the room of the cell its user is about to run
    IDLE = "idle"  # in the background: a full card, or idle past ``suspend_after``
    OVER_BUDGET = "over budget"  # the watchdog, under ``over_budget = "pause"``
    WRONG_GPU = "wrong GPU"  # the watchdog: a process of it holds memory on another card


#: Kernel states, as kernels report them.
ACTIVE, IDLE, PAUSED, SUSPENDED = "active", "idle", "paused", "suspended"
#: The move that takes a paused kernel's context through the driver's checkpoint and
#: straight back (:meth:`.moves.Moves.even`)
EVEN = "even"
#: Where a kernel's memory is (:attr:`Kernel.tier`): on the card, compressed in host
#: memory, spilled to the disk tier, or in the driver's process checkpoint.
TIERS = ("gpu", "host", "disk", "suspended")


@dataclasses.dataclass
class Server:
    """A user's single-user server (or any process tree with a slice).

    Attributes:
        pid: the root of its process tree; every descendant belongs to it (0 for a
            server known by its pod).
        user: the user's name.
        name: the server's name ("" for the default server).
        slice: its slice (the budget is per kernel, as everywhere).
        pod_uid: on Kubernetes, the uid of its pod: every process in the pod's cgroup
            belongs to it (:mod:`.namespaces`); None on one host.
        job_id: on Slurm, the id of its job: every process in the job's cgroup belongs
            to it (:mod:`.slurm`); None elsewhere.
        cgroup: on one host, the path of the server's own cgroup (from the root of
            ``cgroup_hierarchy``): every process in it or below it belongs to it
            (:mod:`jupyter_vgpu.host.cgroups`); None where the server has none (its process tree, then).
        cgroup_hierarchy: the hierarchy of ``cgroup`` (:data:`.cgroups.V2`, or a v1
            hierarchy's name).
        start: the start time of the process ``pid`` (clock ticks after boot), as the
            Hub recorded it when it started the server (else as first seen): once that
            process has ended, ``pid`` names another process, which never inherits the
            slice. None for a server known by its pod or job.
        uid: the uid of the account the server runs as, where the Hub says (None: not
            checked); a process of another uid is never admitted as its kernel.
        process: the process ``pid`` as the arbiter first saw it with that start time
            (its pidfd): once it has ended, its tree is nobody's, even where another
            process took the PID within the same clock tick and so reads the same start
            time. None where it was gone before it was registered, or for a pod or job (``pid`` 0).
    """

    pid: int
    user: str
    name: str
    slice: Slice
    pod_uid: str | None = None
    job_id: str | None = None
    cgroup: str | None = None
    cgroup_hierarchy: str = "cgroup2"
    start: int | None = None
    uid: int | None = None
    process: procs.Identity | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def key(self) -> str:
        return f"{self.user}/{self.name}"

    @property
    def root(self) -> int | str:
        """Its key in the arbiter's books: ``"job:<id>"``, ``"pod:<uid>"``,
        ``"cgroup:<path>"``, or the root PID of its process tree."""
        if self.job_id:
            return f"job:{self.job_id}"
        if self.pod_uid:
            return f"pod:{self.pod_uid}"
        return f"cgroup:{self.cgroup}" if self.cgroup else self.pid


@dataclasses.dataclass
class Kernel:
    """One kernel connected to the arbiter.

    Attributes:
        pid: its process (from the socket's peer credentials, not from what it says).
        server: the server it belongs to.
        kernel_id: the id it gave (a figure for display, not an identity).
        state: one of ACTIVE, IDLE, PAUSED, SUSPENDED.
        since: monotonic seconds when it entered that state.
        resident: bytes it holds on the card (NVML, or its own figure on a simulated GPU);
            for a slice of several cards, on all of them together.
        on_cards: on real cards, the bytes it holds on each card of its slice (NVML
            UUID), as each card was last read; ``resident`` is their sum. Empty on a
            simulated card.
        peak_on_cards: the most it held on each card while on its cards (not paused or
            suspended), since the arbiter's last pause of it began (which takes a fresh
            reading): how its paused bytes split between the cards (:func:`paused_on`).
        paused_bytes: bytes released by its pause (what a resume needs back).
        host_bytes: bytes its paused memory takes in host memory.
        disk_bytes: bytes of its paused memory in the disk tier.
        pausable: what a pause of it as it is now would store at most, before
            compression, as it last said (``pausable_bytes``, version 3; never past its
            budget), or None where it did not say: :func:`.tiers.host_need` takes it
            for its estimate of a pause's host memory.
        cached: the free blocks its allocator keeps cached on its cards, as it last said
            (``cached_bytes``, version 5, a resident kernel on a real card; 0 where it did
            not say): what a release would give back (:func:`releasable`, never past what
            NVML shows it holding).
        checkpoint_bytes: bytes the driver's checkpoint took off the card when it was
            suspended (its resident bytes then; held in host memory while suspended).
        checkpoint_need: those bytes per card (NVML UUID), for a restore to check each
            card of a slice of several; empty when unknown (the first card then needs
            ``checkpoint_bytes``).
        granted: bytes it was promised it may grow to for the cell it runs (its budget, or
            less when the card could never give that much: :func:`growth`).
        asks: where growth is granted on demand (``ArbiterApp.grant_on_demand``), bytes its
            cell is to be granted on the card for now: what it holds and brings back plus
            the margin as the cell starts, raised by each request of the cell to grow
            (``room`` ``for: grow``); 0: its whole budget, as without.
        room_held: bytes a granted prefetch holds for the cell its user is about to run
            (its :func:`growth` then), while it comes back and until ``room_held_until``
            (:meth:`holding`): counted by other prefetches' room ahead (:func:`promised`);
            0: none. Cleared once its cell's room is decided.
        room_held_until: monotonic seconds until which ``room_held`` holds once the kernel
            is back and idle (``ArbiterApp.room_held_seconds`` after it said so).
        group: the processes suspended together, the kernel last (its child processes
            that held memory on the card first); empty unless suspended by the arbiter.
        uid: its user id on the host (the socket's peer credentials).
        disk_dir: its directory of the disk tier, or None where there is no disk tier.
        identity: its process (:class:`.procs.Identity`), taken as it connected: checked
            again before the arbiter suspends, restores or ends it.
        group_ids: the identities of ``group``, taken as they were suspended.
        refused: what it declined (``pause``, ``suspend``, ``spill``, ``trim``) and when
            (monotonic seconds); forgotten when its state changes. A kernel that declined
            to spill holds its host memory on its own account (:func:`cooperative`).
        unresponsive_until: monotonic seconds until which it is not asked anything (it
            let a request go unanswered).
        measured: the bytes NVML showed it holding on its cards just before the
            arbiter's last pause of it, or the most seen since while it was on the cards
            (a pause of its own, ``%vgpu pause``, is bounded by that); None: not measured
            (a simulated card, or paused before this arbiter met it): what its paused
            figure may not pass.
        disk_measured: bytes the arbiter found in its directory of the disk tier at the
            last look (None: not looked): what its disk figure may not pass.
        process: its process's own host memory at the arbiter's last look
            (:func:`jupyter_vgpu.host.procs.memory`, :mod:`.process_memory`); None: not
            measured yet.
        process_at: monotonic seconds of that look.
        trim_asked: monotonic seconds the arbiter last asked it to trim while it was
            paused (0: never): once per pause (:func:`.tiers.paused_to_trim`).
        restored_context: its CUDA context (and its group's) is one the driver restored
            from a process checkpoint (a suspend's restore, or :meth:`.moves.Moves.even`).
            The driver's time-slicing gives such a context about three quarters of the
            card beside one that never left it, and shares evenly between contexts of one
            kind (docs/design.md, the eleventh and twelfth tries).
        unsaid_since: monotonic seconds the arbiter granted it room to run code on a
            request that did not say it was for a cell (:mod:`.turns`); None: its last
            grant said so, or it ran no code since.
        turns_kept: its requests for room take turns whatever they say: it ran code for
            longer than ``ArbiterApp.turn_wait`` on a request that did not say it was for a
            cell (:meth:`.turns.Turns.left_active`).
    """

    pid: int
    server: Server
    kernel_id: str = ""
    state: str = IDLE
    since: float = dataclasses.field(default_factory=time.monotonic)
    resident: int = 0
    on_cards: dict[str, int] = dataclasses.field(default_factory=dict)
    peak_on_cards: dict[str, int] = dataclasses.field(default_factory=dict)
    paused_bytes: int = 0
    host_bytes: int = 0
    disk_bytes: int = 0
    pausable: int | None = None
    cached: int = 0
    checkpoint_bytes: int = 0
    checkpoint_need: dict[str, int] = dataclasses.field(default_factory=dict)
    granted: int = 0
    asks: int = 0
    room_held: int = 0
    room_held_until: float = 0.0
    group: list[int] = dataclasses.field(default_factory=list)
    uid: int = -1
    disk_dir: str | None = None
    identity: object = None
    group_ids: list = dataclasses.field(default_factory=list)
    refused: dict[str, float] = dataclasses.field(default_factory=dict)
    unresponsive_until: float = 0.0
    measured: int | None = None
    disk_measured: int | None = None
    process: procs.Memory | None = None
    process_at: float = 0.0
    trim_asked: float = 0.0
    restored_context: bool = False
    unsaid_since: float | None = None
    turns_kept: bool = False
    capped: bool = False  # a figure of its passed its bound (logged once)
    driver_call: tuple[str, float] | None = None  # a checkpoint call about it now: (what, since, epoch s)
    #: a move of it under way (``pause``, ``suspend``, ``spill``, ``trim``, ``release``,
    #: ``even``): no other begins meanwhile
    moving: str | None = None

    @contextlib.contextmanager
    def move(self, what: str):
        """Marks ``what`` (``pause``, ``suspend``, ``spill``, ``trim``) as its move under
        way (:attr:`moving`) for the ``with`` block, whatever comes of it."""
        self.moving = what
        try:
            yield
        finally:
            self.moving = None

    def hold_room(self, room: int) -> None:
        """Holds ``room`` bytes (the cell's :func:`growth`) for the cell a granted prefetch
        brings this kernel back for, while it comes back (:meth:`holding`); the kernel's
        next states time or end the hold (:meth:`hold_after`)."""
        self.room_held, self.room_held_until = room, 0.0

    def end_hold(self) -> None:
        """Ends the hold: its cell's room is decided, or nothing came back."""
        self.room_held, self.room_held_until = 0, 0.0

    def hold_after(self, was: str, held: int, seconds: float) -> None:
        """The hold once the kernel's state went from ``was`` to :attr:`state` (at
        :attr:`since`); ``held``: :meth:`holding` before the change. Back from its prefetch
        (active to idle), the room stays held ``seconds`` more; a cell that begins within
        the hold keeps the held room as its grant until its request for room is decided;
        any other change ends the hold (a hold the arbiter's pause ended, the books' state
        set by the move itself, is not live before the change and is not carried)."""
        if not self.room_held:
            return
        if was == ACTIVE and self.state == IDLE:
            self.room_held_until = self.since + seconds
            return
        if self.state == ACTIVE and held:
            self.granted = held
        self.end_hold()

    def holding(self, now: float | None = None) -> int:
        """Bytes a granted prefetch holds for its next cell now (``room_held``): while it
        comes back (``active``), and once back and idle until ``room_held_until``; else 0."""
        if not self.room_held:
            return 0
        if self.state == ACTIVE:
            return self.room_held
        if self.state == IDLE and (time.monotonic() if now is None else now) < self.room_held_until:
            return self.room_held
        return 0

    @property
    def slice(self) -> Slice:
        return self.server.slice

    @property
    def budget(self) -> int:
        return self.slice.memory_limit

    @property
    def request(self) -> int:
        """The guaranteed part of the budget, bytes (the whole budget for slices without one)."""
        return getattr(self.slice, "memory_request", None) or self.budget

    @property
    def priority(self) -> int:
        return getattr(self.slice, "priority", 0) or 0

    def idle_for(self, now: float | None = None) -> float:
        """Seconds since it last ran code (0 while it runs)."""
        if self.state == ACTIVE:
            return 0.0
        return (time.monotonic() if now is None else now) - self.since

    @property
    def tier(self) -> str:
        """Where its memory is, one of :data:`TIERS`: ``gpu`` (running or idle: resident),
        ``host`` (paused, compressed in host memory), ``disk`` (paused, spilled to the disk
        tier), ``suspended`` (the driver's process checkpoint)."""
        if self.state == SUSPENDED:
            return "suspended"
        if self.state == PAUSED:
            return "disk" if self.disk_bytes > 0 else "host"
        return "gpu"

    @property
    def host_held(self) -> int:
        """Host memory it holds for the memory of its GPU, bytes: its paused data in host
        memory, the pinned slabs it keeps warm for its next pause (in any state: a
        resident kernel's ``host_bytes`` are those alone), plus the driver's checkpoint
        while suspended or while its context is taken through it (``moving`` ``even``)."""
        checkpointed = self.state == SUSPENDED or self.moving == EVEN
        return self.host_bytes + (self.checkpoint_bytes if checkpointed else 0)

    def describe(self) -> str:
        return f"{self.server.key} (pid {self.pid}, {self.state})"

    def declined(self, action: str, now: float, fresh: float) -> bool:
        """Whether it declined ``action`` less than ``fresh`` seconds before ``now``, or
        does not answer requests now (:attr:`unresponsive_until`)."""
        if now < self.unresponsive_until:
            return True
        when = self.refused.get(action)
        return when is not None and now - when < fresh


def cooperative(kernels: list[Kernel], but: Kernel | None = None) -> list[Kernel]:
    """Those of ``kernels`` whose host memory counts against the node's host budget: all
    but the kernels that declined to move their paused memory to disk (their memory is on
    their own account: it keeps them from being paused further, never anyone else), and
    ``but`` always (a kernel's own memory always counts against its own pause)."""
    return [k for k in kernels if k is but or "spill" not in k.refused]


def _by_card(kernel: Kernel, card: str | None) -> bool:
    """Whether ``kernel``'s figures on ``card`` are its own per-card ones: a slice of
    several real cards, a card named. Otherwise its whole figures stand for the card."""
    return card is not None and not kernel.slice.simulated and len(kernel.slice.gpu_uuids) > 1


def held(kernel: Kernel, card: str | None = None) -> int:
    """Bytes ``kernel`` holds on ``card`` (an NVML UUID): what it holds on that card of a
    slice of several real cards (:attr:`Kernel.on_cards`), else its ``resident`` bytes
    (a slice of one card, a simulated one, or ``card`` None)."""
    if not _by_card(kernel, card):
        return kernel.resident
    return kernel.on_cards.get(card, 0)


def ceiling(kernel: Kernel, free: int, others: list[Kernel], card: str | None = None) -> int:
    """The most ``kernel`` could ever hold on its card, bytes: the free memory plus what
    every kernel on the card holds (all of it could be taken off). What other processes
    and the driver hold is out of reach, so a budget above this can never be met in full.

    Args:
        kernel: the kernel that wants to run.
        free: free bytes on its card now.
        others: the card's other kernels.
        card: the card (NVML UUID), where a kernel of several cards may be among them
            (:func:`held`); None: each kernel's ``resident`` bytes.
    """
    return free + held(kernel, card) + sum(held(k, card) for k in others)


def growth(kernel: Kernel, free: int, others: list[Kernel], card: str | None = None) -> int:
    """What ``kernel`` is granted when it runs, bytes: its budget, capped at :func:`ceiling`;
    where growth is granted on demand, what it asks for now (:attr:`Kernel.asks`), capped
    the same."""
    whole = min(kernel.budget, ceiling(kernel, free, others, card))
    return min(whole, kernel.asks) if kernel.asks > 0 else whole


def start_asks(kernel: Kernel, margin: int, card: str | None = None) -> int:
    """What a cell of ``kernel`` is granted as it starts, where growth is granted on demand
    (``ArbiterApp.grant_on_demand``), bytes: what the kernel holds on ``card``
    (:func:`held`), what it brings back there (:func:`prefetch_need`) and ``margin``
    bytes, at most its budget; the rest is made when the cell grows (:func:`grow_asks`).

    A grant of the whole budget makes every running cell's room at its start, whatever
    the cell will use; on demand, a cell that uses well below its budget has no idle
    kernel taken off the card for the rest (docs/design.md, "Growth on demand")."""
    return min(kernel.budget, held(kernel, card) + prefetch_need(kernel, card) + margin)


def grow_asks(kernel: Kernel, nbytes: int, margin: int, card: str | None = None) -> int:
    """What ``kernel``'s running cell asks for once an allocation of ``nbytes`` bytes found
    no room on the card: what it was granted or holds, whichever is more, plus
    ``nbytes`` and ``margin``, at most its budget; never less than it was granted."""
    want = min(kernel.budget, max(kernel.granted, held(kernel, card)) + nbytes + margin)
    return max(kernel.granted, want)


def admission_short(kernel: Kernel, free: int, others: list[Kernel], card: str | None = None) -> int:
    """Where growth is granted on demand: bytes by which the budgets of the card's running
    cells and of ``kernel``'s would pass what the card could ever give them all at once
    (:func:`ceiling`: its free memory and everything the card's kernels hold, which
    pauses and suspends can take off); 0 when they fit. A cell is admitted only where
    they fit, so the room of any running cell's growth up to its budget can always be
    made by taking idle kernels off the card, never a running cell: a grant below the
    budget never turns into an out-of-memory error below it.

    Args:
        kernel: the kernel that wants to run.
        free: free bytes on its card now.
        others: the card's other kernels (those running count).
        card: the card (:func:`held`).
    """
    room = ceiling(kernel, free, others, card)
    running = sum(min(k.budget, room) for k in others if k.state == ACTIVE)
    return max(0, min(kernel.budget, room) + running - room)


def shortfall(
    kernel: Kernel,
    free: int,
    others: list[Kernel],
    card: str | None = None,
    holds: bool = False,
    now: float | None = None,
) -> int:
    """Bytes that must still be freed on the card before ``kernel`` may run.

    ``kernel`` may grow to its budget (or to what the card could ever give it, when the
    budget is larger: :func:`ceiling`); it holds ``resident`` already, and a paused or
    suspended kernel needs its paused bytes back first. Every other running kernel keeps
    the growth it was granted. Free memory is the card's, as measured.

    Args:
        kernel: the kernel that wants to run.
        free: free bytes on its card now.
        others: the card's other kernels.
        card: the card (:func:`held`).
        holds: count the room granted prefetches hold for their cells too
            (:func:`promised`): a prefetch's room ahead does, a cell's own room does not.
        now: ``time.monotonic()`` (default: read now), for the holds.
    """
    need = max(0, growth(kernel, free, others, card) - held(kernel, card))
    return max(0, need + promised(others, card, holds, now) - free)


def paused_on(kernel: Kernel, card: str | None = None) -> int:
    """Bytes of ``kernel``'s paused memory that a resume brings back to ``card`` (NVML
    UUID): for a slice of several real cards, its ``paused_bytes`` split as it held its
    memory between them before its pause (:attr:`Kernel.peak_on_cards`; all on the
    first card where that is unknown); else all of them (``card`` None too)."""
    if not _by_card(kernel, card):
        return kernel.paused_bytes
    cards = kernel.slice.gpu_uuids
    seen = {c: kernel.peak_on_cards.get(c, 0) for c in cards}
    total = sum(seen.values())
    if total <= 0:
        return kernel.paused_bytes if card == cards[0] else 0
    return kernel.paused_bytes * seen.get(card, 0) // total


def prefetch_need(kernel: Kernel, card: str | None = None) -> int:
    """Bytes a prefetch of ``kernel`` brings back to ``card``: its paused bytes there
    (:func:`paused_on`) and what its restore from the driver's checkpoint takes there
    (:attr:`Kernel.checkpoint_need`; its whole ``checkpoint_bytes`` where that is unknown
    or ``card`` is None)."""
    if card is None or not kernel.checkpoint_need:
        restore = kernel.checkpoint_bytes
    else:
        restore = kernel.checkpoint_need.get(card, 0)
    return paused_on(kernel, card) + restore


def promised(
    others: list[Kernel], card: str | None = None, holds: bool = False, now: float | None = None
) -> int:
    """Bytes the kernels of ``others`` were promised on ``card`` and do not hold yet: each
    running cell's room (:func:`growth`, ``granted``) less :func:`held`; with ``holds``,
    also the room a granted prefetch holds for the cell its user is about to run
    (:meth:`Kernel.holding`), which another prefetch's room ahead counts (:func:`room_ahead`)
    and a cell's own room does not (a user who pressed run is not kept waiting for one
    who is about to).

    The hold: a prefetched kernel's room was free memory on the card until its cell ran,
    and the next prefetch, seeing it free, made no room ahead of its own cell, which then
    made its room as it started: 26 of 89 prefetched cells of two runs of 48 MLP sessions
    waited at their start for a pause or suspend made then, 0.12-2.84 s (13 over 0.4 s, 18
    with no room made ahead; seeds 11 and 7 at b101c5c, and 45 of 137 in three runs at
    777869e: ``benchmarks/results/cell-tails-h100.json``, ``benchmarks/sessions_tail.py``),
    pauses that took 0.21 s at the median with a cell running beside them (0.33 s with two)
    against 0.08 s with none. Measured at 12x, holds of 5 s made this worse (more suspends
    ahead, the host's budget reached): ``ArbiterApp.room_held_seconds`` is 0 by default
    (docs/design.md, the tenth try).

    A kernel whose context the driver takes off the card and straight back (``moving``
    ``even``: :meth:`.moves.Moves.even`) is promised what the checkpoint takes, whatever
    it holds meanwhile: NVML may show it gone before the books do, and its restore needs
    it back."""
    return sum(_promised(k, card, holds, now) for k in others)


def _promised(k: Kernel, card: str | None, holds: bool, now: float | None) -> int:
    if k.moving == EVEN:
        return k.checkpoint_bytes if card is None else k.checkpoint_need.get(card, k.checkpoint_bytes)
    return max(0, max(k.granted if k.state == ACTIVE else 0, k.holding(now) if holds else 0) - held(k, card))


def prefetch_short(kernel: Kernel, free: int, others: list[Kernel], card: str | None = None) -> int:
    """Bytes missing before ``kernel`` (paused or suspended: its paused bytes and what the
    driver's checkpoint took, :func:`prefetch_need`) may come back ahead of its next
    cell; 0 when it may: it fits in the free memory beside what running kernels were
    promised (:func:`promised`). The caller first pauses kernels idle past their
    ``idle_seconds`` down to the watermark (:func:`prefetch_owed`).

    The watermark is the target of those pauses, not a condition of the grant: a card
    whose CUDA contexts alone fill most of it stays above any watermark that pauses can
    reach (48 MLP sessions: 48 contexts of 0.73 GiB, 44% of the card, against a watermark
    of 0.6), and a prefetch held to it was refused whenever a cell ran: 39 and 44 of 48
    prefetches refused, 0.9 to 34 GiB "short", and as many cells then waited for their
    kernel's resume (seeds 7 and 11 at 4558c36,
    ``benchmarks/results/sessions-h100.json``). A kernel brought back above the watermark
    is the last the background look would pause (the most recently idle).

    Args:
        kernel: the kernel to bring back.
        free: free bytes on its card now (NVML).
        others: the card's other kernels.
        card: the card (NVML UUID), for a kernel of several cards: what it brings back to
            that card alone and the others' holdings there; None: the kernels' whole figures.
    """
    return max(0, prefetch_need(kernel, card) + promised(others, card) - free)


def prefetch_owed(
    kernel: Kernel,
    used: int,
    total: int,
    others: list[Kernel],
    watermark: float,
    now: float,
    card: str | None = None,
) -> list:
    """The pauses that make room for a prefetch of ``kernel`` (:func:`prefetch_short`)
    among the kernels the background look may pause (:func:`ahead_of_time`: idle past
    their slice's ``idle_seconds``, longest idle first), ``[(kernel, "pause")]``: until the
    card, counting in use what ``kernel`` brings back and what the running kernels were
    promised, is at or below ``watermark``; what the pauses cannot bring under it (contexts,
    running cells) stays, and the prefetch needs only free memory beside the promises.

    The promises count: a running cell is granted its budget (:func:`growth`), so on a
    card where cells of several gigabytes run, the prefetch of a small working set was
    refused while idle kernels past their ``idle_seconds`` held the card: 47 of 48 MLP
    sessions' prefetches were refused, 1.1 to 51 GiB short
    (``benchmarks/results/sessions-mlp-h200.json``, 48 sessions, seed 7).

    Args:
        kernel: the kernel to bring back.
        used: bytes in use on its card now (NVML).
        total: the card's memory, bytes.
        others: the card's other kernels.
        watermark: the arbiter's watermark, a fraction of ``total``.
        now: ``time.monotonic()``.
        card: the card (NVML UUID), as for :func:`prefetch_short`.
    """
    counted = used + prefetch_need(kernel, card) + promised(others, card)
    return ahead_of_time(others, counted, total, watermark, now, card)


#: The most suspends made at once for one kernel's room: the checkpoint pool's workers
#: (:class:`.checkpoint_pool.CheckpointPool`, 8), so none of them waits for a worker.
SUSPENDS_AT_ONCE = 8


def suspends_together(order: list, short: int, card: str | None = None) -> list[Kernel]:
    """The kernels at the head of ``order`` (:func:`victims`' list, or what is left of it)
    to suspend at once for a shortfall of ``short`` bytes: those whose action is
    ``suspend``, in order, until what they hold on ``card`` (:func:`held`: a paused
    kernel's CUDA context and what its pause left) covers ``short``, at most
    :data:`SUSPENDS_AT_ONCE`; ``[]`` when the head is a pause.

    A paused kernel's suspend frees its context alone (0.73 GiB of an MLP kernel), so a
    cell's room can take many; one after another, they kept a cell waiting 10.7 s for 8
    suspends of 0.53 to 2.78 s each (48 MLP sessions, seed 7, at 4558c36,
    ``benchmarks/results/sessions-h100.json``). The driver's checkpoint of one process
    does not wait for another's."""
    out, freed = [], 0
    for kernel, action in order:
        if action != "suspend" or len(out) == SUSPENDS_AT_ONCE or freed >= short:
            break
        out.append(kernel)
        freed += held(kernel, card)
    return out


def victims(
    card_kernels: list[Kernel], asking: Kernel, suspend_after: float, now: float | None = None
) -> list:
    """Kernels to take off the card for ``asking``, in order, with what to do to each:
    ``[(kernel, "pause" | "suspend")]``. Only idle or paused kernels qualify (never a
    running one, never ``asking``); a paused kernel can still give its CUDA context back
    by being suspended.

    Order: suspensions due (paused longer than ``suspend_after``), then pauses by
    longest idle, lowest priority, most above request; then the remaining suspensions;
    last, the idle kernels whose granted prefetch holds room for the cell their user is
    about to run (``room_held``: brought back a moment ago for it).
    ``suspend_after`` 0 (``ArbiterApp.suspend_after``: never suspend) leaves paused
    kernels paused: pauses only. A paused kernel holding nothing on the card (``resident``
    0: it never made a CUDA context) is no candidate: a suspend would free nothing, and
    the arbiter would wait for NVML to show it (on the H100, 32 sessions starting: 2 s
    for each of nine such suspends).
    """
    now = time.monotonic() if now is None else now
    idle = [k for k in card_kernels if k is not asking and k.state == IDLE]
    paused = [k for k in card_kernels if k is not asking and k.state == PAUSED and k.resident > 0]
    if suspend_after <= 0:
        paused = []
    due = [k for k in paused if k.idle_for(now) >= suspend_after]
    rest = [k for k in paused if k not in due]
    holding = [k for k in idle if k.holding(now) > 0]
    idle = [k for k in idle if k not in holding]
    idle.sort(key=lambda k: (-k.idle_for(now), k.priority, -(k.resident - k.request)))
    due.sort(key=lambda k: -k.idle_for(now))
    rest.sort(key=lambda k: -k.idle_for(now))
    return (
        [(k, "suspend") for k in due]
        + [(k, "pause") for k in idle]
        + [(k, "suspend") for k in rest]
        + [(k, "pause") for k in holding]
    )


def releasable(kernel: Kernel, card: str | None = None) -> int:
    """Bytes a release of ``kernel`` would give back on ``card`` (an NVML UUID): the free
    blocks it says its allocator keeps cached (:attr:`Kernel.cached`), never more than it
    holds there (:func:`held`, NVML's); 0 unless it is idle with no move under way."""
    if kernel.state != IDLE or kernel.moving is not None:
        return 0
    return max(0, min(kernel.cached, held(kernel, card)))


def releases(order: list, short: int, card: str | None = None) -> list[Kernel]:
    """The idle kernels to ask for a release before anyone is paused or suspended for a
    room ``short`` bytes short on ``card``: those of ``order`` (:func:`victims`, in its
    order, pauses only) with something to release (:func:`releasable`), up to the first
    whose releases together cover ``short``; ``[]`` where all of them together would not
    (the pauses that room needs release the caches anyway, and a release first would be a
    round trip for nothing)."""
    picked, total = [], 0
    if short <= 0:
        return picked
    for kernel, action in order:
        nbytes = releasable(kernel, card) if action == "pause" else 0
        if nbytes <= 0:
            continue
        picked.append(kernel)
        total += nbytes
        if total >= short:
            return picked
    return []


def room_ahead(
    kernel: Kernel, free: int, others: list[Kernel], suspend_after: float, now: float, card: str | None = None
) -> tuple[int, list]:
    """What a prefetch of ``kernel`` takes off the card for the cell its user is about to
    run, decided before the kernel comes back: ``(short, [(victim, action)])``, where
    ``short`` is the kernel's :func:`shortfall` (its paused bytes back and its growth to
    its budget, beside the running cells' promises and the rooms other granted prefetches
    hold for their cells; bytes) and the victims are
    :func:`victims`' order less the idle kernels within their slice's ``idle_seconds``
    (a user who ran a cell a moment ago is not paused for a cell that has not started),
    until what they hold on ``card`` (:func:`held`) covers ``short``.

    A prefetch that brought back only the paused bytes left the cell to make the rest of
    its room when it ran: on a card of 48 MLP sessions (48 CUDA contexts of 0.73 GiB
    beside 17 GiB budgets) a prefetched kernel's cell waited 11.8 s for 11 suspends of
    paused kernels (seed 7 at 09f6060, ``benchmarks/results/sessions-h100.json``), where
    the edit before it gave 2 s to make them. A pause frees less than :func:`held` (the
    context stays), so the list may fall short; the cell's own request makes the rest.
    """
    short = shortfall(kernel, free, others, card, holds=True, now=now)
    if short <= 0:
        return 0, []
    return short, covering(kernel, short, others, suspend_after, now, card)


def covering(
    kernel: Kernel,
    short: int,
    others: list[Kernel],
    suspend_after: float,
    now: float,
    card: str | None = None,
) -> list:
    """The victims a prefetch of ``kernel`` may take off the card for ``short`` bytes
    (its cell's room, :func:`room_ahead`, or its own return, :func:`prefetch_short`):
    :func:`victims`' order less the idle kernels within their slice's ``idle_seconds``,
    until what they hold on ``card`` (:func:`held`) covers ``short``; ``[(victim, action)]``."""
    out, freed = [], 0
    for victim, action in victims(others, kernel, suspend_after, now):
        if action == "pause" and victim.idle_for(now) < victim.slice.idle_seconds:
            continue
        out.append((victim, action))
        freed += held(victim, card)
        if freed >= short:
            break
    return out


def running_cells(kernels: list[Kernel]) -> list[Kernel]:
    """Those of ``kernels`` that run a cell with its room granted (``active``, ``granted``
    above 0; a prefetched kernel's cell counts from its grant): a kernel that reports a
    cell started but waits for its room does not, so two cells waiting for room never wait
    for each other."""
    return [k for k in kernels if k.state == ACTIVE and k.granted > 0]


def quiet(card_kernels: list[Kernel]) -> bool:
    """True when no kernel on the card runs code (none is ``active``).

    Background pauses and suspends wait for a quiet card: a pause works the card too
    (compression kernels and copies, time-sliced with the running cell's kernels), and
    it is not needed yet. Measured on the H100 (``benchmarks/sessions.py``): background
    pauses of 2 GiB working sets during other users' 1 s cells made those cells 0.1 s
    slower (steps 0.141 s to 0.175 s while a pause ran). Room on demand is not deferred:
    a kernel that needs room gets it at once.
    """
    return all(k.state != ACTIVE for k in card_kernels)


def ahead_of_time(
    card_kernels: list[Kernel], used: int, total: int, watermark: float, now: float, card: str | None = None
) -> list:
    """Kernels to pause in the background on a card above ``watermark`` (a fraction of
    its memory in use): idle longer than their slice's ``idle_seconds``, longest idle
    first, until the card would be under the watermark, each counted by what it holds on
    ``card`` (:func:`held`: a kernel of several cards frees its share there);
    ``[(kernel, "pause")]``. The caller asks only for a :func:`quiet` card."""
    if used <= watermark * total:
        return []
    out, freed = [], 0
    for k in sorted(card_kernels, key=lambda k: -k.idle_for(now)):
        if k.state != IDLE or k.idle_for(now) < k.slice.idle_seconds:
            continue
        out.append((k, "pause"))
        freed += held(k, card)
        if used - freed <= watermark * total:
            break
    return out
