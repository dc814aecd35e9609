"""Budgets a user cannot lift: the arbiter's watchdog, from outside the kernels.

``torch.cuda.set_per_process_memory_fraction`` is a courtesy the user can undo (the
design map: a 2 GiB kernel set it to 1.0 and took 20 GiB). The watchdog looks at the
card instead: every ``poll_seconds`` it takes NVML's bytes per process, maps each
process to the registered server whose process tree it belongs to (kernels, their
subprocesses, terminals: whatever runs under the server), and compares each with the
slice's budget. A process over its budget is warned at once (its kernel shows the
notice, the arbiter logs it); if it is still over after ``grace_seconds`` the admin's
policy applies: ``report`` (keep warning), ``pause`` (pause the kernel if it is idle,
else keep warning), or ``kill`` (end the process). Each action is logged and counted.

:meth:`Watchdog.step` is pure: it turns one reading into actions, so its decisions are
tested without a driver.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

POLICIES = ("report", "pause", "kill")


@dataclasses.dataclass(frozen=True)
class Action:
    """One thing to do about one process.

    Attributes:
        kind: ``warn`` (first seen over), or the policy once the grace period has passed
            (``report``, ``pause``, ``kill``).
        pid: the process.
        server: the server it belongs to (``user/name``).
        used: its bytes on the card, per NVML.
        budget: its slice's budget, bytes.
        over_for: seconds since it was first seen over.
    """

    kind: str
    pid: int
    server: str
    used: int
    budget: int
    over_for: float

    def message(self) -> str:
        gib = 2**30
        what = {
            "warn": "is over its vGPU budget",
            "report": "is still over its vGPU budget",
            "pause": "was over its vGPU budget: paused",
            "kill": "was over its vGPU budget: ended",
        }[self.kind]
        return (
            f"process {self.pid} of {self.server} {what} "
            f"({self.used / gib:.2f} GiB on the GPU, budget {self.budget / gib:.2f} GiB)"
        )


class Watchdog:
    """Decides what to do about processes over their budget.

    Args:
        policy: one of :data:`POLICIES`.
        grace_seconds: how long a process may stay over before the policy applies.
        remind_seconds: how often ``report`` repeats itself.
    """

    def __init__(self, policy: str = "report", grace_seconds: float = 10.0, remind_seconds: float = 60.0):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        self.policy, self.grace, self.remind = policy, grace_seconds, remind_seconds
        self._since: dict[int, float] = {}  # pid -> when first seen over
        self._acted: dict[int, float] = {}  # pid -> when the policy last applied

    def step(
        self,
        now: float,
        processes: dict[int, int],
        owner: Callable[[int], tuple[str, int] | None],
    ) -> list[Action]:
        """The actions for one reading.

        Args:
            now: seconds (monotonic).
            processes: bytes on the card per PID (NVML).
            owner: maps a PID to ``(server key, budget bytes)``, or None for processes
                of no registered server (they are not ours to police).
        """
        actions = []
        over_now = set()
        for pid, used in processes.items():
            found = owner(pid)
            if found is None:
                continue
            server, budget = found
            if used <= budget:
                continue
            over_now.add(pid)
            since = self._since.setdefault(pid, now)
            over_for = now - since
            if since == now:
                actions.append(Action("warn", pid, server, used, budget, 0.0))
            elif over_for >= self.grace:
                last = self._acted.get(pid)
                if last is None or (self.policy == "report" and now - last >= self.remind):
                    self._acted[pid] = now
                    actions.append(Action(self.policy, pid, server, used, budget, over_for))
        for pid in list(self._since):  # back under budget, or gone: forget
            if pid not in over_now:
                self._since.pop(pid, None)
                self._acted.pop(pid, None)
        return actions


def owners(
    servers: Iterable, root_of: Callable[[int], int | str | None]
) -> Callable[[int], tuple[str, int] | None]:
    """The ``owner`` function of :meth:`Watchdog.step` over registered servers.

    Args:
        servers: the arbiter's :class:`~.books.Server` objects.
        root_of: maps a PID to the root it belongs to (a registered root PID it
            descends from, or ``"pod:<uid>"`` of its pod), or None.
    """
    by_root = {s.root: s for s in servers}

    def owner(pid: int):
        root = root_of(pid)
        server = by_root.get(root) if root is not None else None
        return (server.key, server.slice.memory_limit) if server is not None else None

    return owner
