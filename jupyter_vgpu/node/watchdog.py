"""Budgets a user cannot lift: the arbiter's watchdog, from outside the kernels.

``torch.cuda.set_per_process_memory_fraction`` is a courtesy the user can undo (the
design map: a 2 GiB kernel set it to 1.0 and took 20 GiB). The watchdog looks at the
cards instead: every ``poll_seconds`` it takes NVML's bytes per process on every card
the arbiter manages, maps each process to the registered server it belongs to (by its
cgroup, its pod, or its process tree: kernels, their subprocesses, terminals, daemons
they started), and compares **each server's sum** with its slice's budget. A server over
its budget (on any one card: a slice of several cards has the budget on each) is warned
at once (its kernels show the notice, the arbiter logs it, naming each of its processes
and their bytes); if it is still over after ``grace_seconds`` the admin's policy
applies: ``report`` (keep warning, every ``remind_seconds``), ``pause`` (pause its idle
kernels, then keep warning), or ``kill`` (end its processes, largest first, until the
rest fits; again at each look while it is over).

**Its own cards**: a slice is one card, or several of one host (the spawner sets
``CUDA_VISIBLE_DEVICES`` to them), but a user can clear that variable before CUDA
starts, in a kernel or in a process it starts. A server's process holding memory on a
managed card that is not one of its slice's is *on the wrong GPU*: warned at once,
whatever its bytes, and after the grace period the same policy applies to the processes
on other cards (``kill`` ends them all: any byte there is outside the slice).

**Default deny**: a process on a managed card that belongs to no server, and that the
allowlist does not name (the arbiter, MPS daemons, monitoring agents, admin processes:
``ArbiterApp.allowed_executables``, ``allowed_cgroups``), is *unowned*: warned at once,
then ``unowned_policy`` applies (``report`` or ``kill``) after the same grace period.

:meth:`Watchdog.step` is pure: it turns one reading into actions, so its decisions are
tested without a driver.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

POLICIES = ("report", "pause", "kill")
UNOWNED_POLICIES = ("report", "kill")
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Owner:
    """Whose a process is: its server's key in the books (``Server.root``), the server's
    name (``user/name``), its budget (bytes, on each card), how it was found
    (``cgroup``, ``pod``, ``tree``) and its slice's cards (NVML UUIDs; empty where the
    watchdog has no card to hold it to: see :func:`owners`)."""

    key: int | str
    server: str
    budget: int
    mapped_by: str
    gpus: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Action:
    """One thing to do about one process.

    Attributes:
        kind: ``warn`` (first seen over, or first seen unowned), or the policy once the
            grace period has passed (``report``, ``pause``, ``kill``).
        pid: the process.
        server: the server it belongs to (``user/name``); "" for an unowned process.
        used: its bytes on the managed cards, per NVML.
        total: its server's bytes on them, all processes together (``used`` when unowned).
        budget: the server's budget, bytes (None when unowned).
        over_for: seconds since the server (or the unowned process) was first seen.
        mapped_by: how the process was mapped: ``cgroup``, ``pod``, ``tree``, or
            ``unowned``.
        processes: the server's processes on the cards, ``(pid, bytes)``, largest first.
        elsewhere: for a process on the wrong GPU, the cards outside its slice where it
            holds memory, ``(NVML UUID, bytes)``; empty for a budget or unowned action.
    """

    kind: str
    pid: int
    server: str
    used: int
    total: int
    budget: int | None
    over_for: float
    mapped_by: str
    processes: tuple[tuple[int, int], ...] = ()
    elsewhere: tuple[tuple[str, int], ...] = ()

    @property
    def unowned(self) -> bool:
        return self.budget is None

    @property
    def wrong_gpu(self) -> bool:
        return bool(self.elsewhere)

    def message(self) -> str:
        if self.unowned:
            what = {
                "warn": "belongs to no vGPU server",
                "report": "still belongs to no vGPU server",
                "kill": "belonged to no vGPU server: ended",
            }[self.kind]
            return f"process {self.pid} on a managed GPU {what} ({self.used / GiB:.2f} GiB on the GPU)"
        if self.wrong_gpu:
            what = {
                "warn": "uses a GPU outside its vGPU slice",
                "report": "still uses a GPU outside its vGPU slice",
                "pause": "used a GPU outside its vGPU slice: paused",
                "kill": "used a GPU outside its vGPU slice: ended",
            }[self.kind]
            where = ", ".join(f"{used / GiB:.2f} GiB on {uuid}" for uuid, used in self.elsewhere)
            return f"process {self.pid} of {self.server} {what} ({where})"
        what = {
            "warn": "is over its vGPU budget",
            "report": "is still over its vGPU budget",
            "pause": "was over its vGPU budget: paused",
            "kill": "was over its vGPU budget: ended",
        }[self.kind]
        each = ", ".join(f"process {pid}: {used / GiB:.2f} GiB" for pid, used in self.processes)
        return (
            f"process {self.pid} of {self.server} {what} "
            f"({self.total / GiB:.2f} GiB on the GPU for the server, "
            f"budget {self.budget / GiB:.2f} GiB; {each})"
        )


class Watchdog:
    """Decides what to do about servers over their budget and unowned processes.

    Args:
        policy: one of :data:`POLICIES`, for servers over their budget.
        grace_seconds: how long a server may stay over (or an unowned process run)
            before the policy applies.
        remind_seconds: how often ``report`` repeats itself.
        unowned_policy: one of :data:`UNOWNED_POLICIES`, for unowned processes.
    """

    def __init__(
        self,
        policy: str = "report",
        grace_seconds: float = 10.0,
        remind_seconds: float = 60.0,
        unowned_policy: str = "report",
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        if unowned_policy not in UNOWNED_POLICIES:
            raise ValueError(
                f"unowned_policy must be one of {', '.join(UNOWNED_POLICIES)}, not {unowned_policy!r}"
            )
        self.policy, self.grace, self.remind = policy, grace_seconds, remind_seconds
        self.unowned_policy = unowned_policy
        self._since: dict = {}  # server key or ("unowned", pid) -> when first seen
        self._acted: dict = {}  # same keys -> when the policy last applied

    def _due(self, key, policy: str, now: float) -> bool:
        """Whether ``policy`` applies to ``key`` now (past its grace period; ``kill``
        at every look, the others once and then every ``remind_seconds`` as reports)."""
        if now - self._since[key] < self.grace:
            return False
        last = self._acted.get(key)
        if policy == "kill" or last is None or now - last >= self.remind:
            self._acted[key] = now
            return True
        return False

    def step(
        self,
        now: float,
        processes: dict[int, int],
        owner: Callable[[int], Owner | None],
        allowed: Callable[[int], bool] = lambda pid: True,
        cards: dict[int, dict[str, int]] | None = None,
    ) -> list[Action]:
        """The actions for one reading.

        Args:
            now: seconds (monotonic).
            processes: bytes on the managed cards per PID (NVML, summed over cards).
            owner: maps a PID to its :class:`Owner`, or None for processes of no server.
            allowed: whether a process of no server may use a managed card (the
                allowlist); the default allows every one (no default deny).
            cards: bytes per card (NVML UUID) per PID, the same reading by card; None
                (one card, or simulated ones) looks at budgets alone.
        """
        actions: list[Action] = []
        servers: dict = {}
        how: dict[int, str] = {}  # pid -> how it was mapped to its server
        seen = set()
        for pid, used in processes.items():
            found = owner(pid)
            if found is not None:
                servers.setdefault(found.key, (found, []))[1].append((pid, used))
                how[pid] = found.mapped_by
                continue
            if allowed(pid):
                continue
            key = ("unowned", pid)
            seen.add(key)
            since = self._since.setdefault(key, now)
            if since == now:
                actions.append(Action("warn", pid, "", used, used, None, 0.0, "unowned"))
            elif self._due(key, self.unowned_policy, now):
                actions.append(Action(self.unowned_policy, pid, "", used, used, None, now - since, "unowned"))
        for key, (found, procs) in servers.items():
            total = sum(used for _, used in procs)
            actions += self._wrong_gpu(now, key, found, procs, total, cards or {}, how, seen)
            if len(found.gpus) > 1 and cards:  # the budget holds on each card: judge the fullest
                procs, total = _fullest_card(found, procs, cards)
            if total <= found.budget:
                continue
            seen.add(key)
            procs.sort(key=lambda p: -p[1])
            since = self._since.setdefault(key, now)

            def action(kind: str, pid: int, used: int, found=found, procs=procs, total=total, since=since):
                return Action(
                    kind, pid, found.server, used, total, found.budget, now - since, how[pid], tuple(procs)
                )

            if since == now:
                actions.append(action("warn", *procs[0]))
            elif self._due(key, self.policy, now):
                if self.policy == "kill":  # largest first, until the rest fits
                    left = total
                    for pid, used in procs:
                        if left <= found.budget:
                            break
                        actions.append(action("kill", pid, used))
                        left -= used
                elif self.policy == "pause":
                    actions += [action("pause", pid, used) for pid, used in procs]
                else:
                    actions.append(action("report", *procs[0]))
        for key in list(self._since):  # back under budget, back on its card, or gone: forget
            if key not in seen:
                self._since.pop(key, None)
                self._acted.pop(key, None)
        return actions

    def _wrong_gpu(self, now, key, found: Owner, procs, total: int, cards, how, seen) -> list[Action]:
        """The actions for a server's processes holding memory on cards other than its
        slice's (none when its cards are not known, ``found.gpus`` empty); ``total`` is the
        server's bytes on all cards."""
        if not found.gpus:
            return []
        off = []
        for pid, _ in procs:
            held = cards.get(pid, {})
            elsewhere = tuple(sorted((u, b) for u, b in held.items() if u not in found.gpus and b > 0))
            if elsewhere:
                off.append((pid, elsewhere))
        if not off:
            return []
        key = ("wrong gpu", key)
        seen.add(key)
        since = self._since.setdefault(key, now)

        def action(kind: str, pid: int, elsewhere) -> Action:
            used = sum(b for _, b in elsewhere)
            return Action(
                kind, pid, found.server, used, total, found.budget, now - since, how[pid], (), elsewhere
            )

        if since == now:
            return [action("warn", pid, elsewhere) for pid, elsewhere in off]
        if self._due(key, self.policy, now):
            return [action(self.policy, pid, elsewhere) for pid, elsewhere in off]
        return []


def _fullest_card(found: Owner, procs, cards: dict[int, dict[str, int]]) -> tuple[list, int]:
    """The server's processes with their bytes on its slice's fullest card, and that
    card's total: what a budget that holds on each card is judged on."""
    totals = {u: sum(cards.get(pid, {}).get(u, 0) for pid, _ in procs) for u in found.gpus}
    fullest = max(found.gpus, key=lambda u: totals[u])
    return [(pid, cards.get(pid, {}).get(fullest, 0)) for pid, _ in procs], totals[fullest]


#: Server keys of servers whose card a scheduler picks, not the slice: Kubernetes' device
#: plugin (``pod:``) and Slurm (``job:``, which confines the job to its GRES itself); their
#: slice names the card only once the Hub has read where the pod or job landed.
SCHEDULED = ("pod:", "job:")


def owners(
    servers: Iterable,
    mapping: Callable[[int], tuple[int | str, str] | None],
    cards: Iterable[str] | None = None,
) -> Callable[[int], Owner | None]:
    """The ``owner`` function of :meth:`Watchdog.step` over registered servers.

    Args:
        servers: the arbiter's :class:`~.books.Server` objects.
        mapping: maps a PID to ``(server key, how)`` (``Arbiter.mapping``), or None.
        cards: the cards (NVML UUIDs) read at this look; an owner's ``gpus`` are its
            slice's cards only where each is one of them (not a placeholder id of a card
            not yet reported, nor a simulated card) and the slice placed the server
            there (not a pod's or a Slurm job's, see :data:`SCHEDULED`). None: every
            real slice's cards.
    """
    by_root = {s.root: s for s in servers}
    known = None if cards is None else set(cards)

    def owner(pid: int) -> Owner | None:
        found = mapping(pid)
        server = by_root.get(found[0]) if found is not None else None
        if server is None:
            return None
        gpus = server.slice.gpu_uuids
        if (
            server.slice.simulated
            or (known is not None and not known.issuperset(gpus))
            or (isinstance(server.root, str) and server.root.startswith(SCHEDULED))
        ):
            gpus = ()
        return Owner(server.root, server.key, server.slice.memory_limit, found[1], gpus)

    return owner
