"""The states of a kernel's pause, and of its pause engine, as named constants.

:class:`PauseState` is the one list of them: the kernel's gate moves through all seven
(:mod:`..gate`, with ``busy`` where the kernel is ``active``), its pause engine is
``active`` (its memory on the device) or ``paused`` (on the host). The members are
``str``: they compare equal to, hash like, print as and serialize (``json.dumps``) as
the plain strings the kernel has always written, so the documents that carry them keep
their form: the kernel report's ``pause.state`` (all seven) and ``state``
(:attr:`PauseState.kernel_state`, the four of ``kernel_state`` in
``contracts/kernel-report.schema.json``), the server's usage document that copies them,
and the arbiter protocol's ``state`` (the same four: ``kernel-state`` in
``contracts/to-arbiter.schema.json``).
"""

from __future__ import annotations

import enum


class PauseState(str, enum.Enum):
    """A kernel's state, transitions included, or its pause engine's."""

    ACTIVE = "active"  # running a message; of the engine: its memory on the device
    IDLE = "idle"  # nothing runs; it may be paused
    PAUSING = "pausing"  # its memory is leaving the device
    PAUSED = "paused"  # its memory is in host memory (or the node's disk tier)
    SUSPENDING = "suspending"  # the driver's checkpoint is taking the whole process
    SUSPENDED = "suspended"  # the whole process is in the driver's checkpoint
    RESUMING = "resuming"  # its memory is coming back; every message waits for it

    # the plain string wherever it is shown or formatted, as before it was a constant
    __str__ = str.__str__
    __format__ = str.__format__

    @property
    def kernel_state(self) -> PauseState:
        """The kernel's state as its report's ``state`` and the arbiter protocol carry it
        (``active``, ``idle``, ``paused`` or ``suspended``): a transition counts as where
        the memory is while it runs (pausing: still on the device; suspending: off it;
        resuming: running)."""
        return _KERNEL_STATE.get(self, self)


_KERNEL_STATE = {
    PauseState.PAUSING: PauseState.IDLE,
    PauseState.SUSPENDING: PauseState.PAUSED,
    PauseState.RESUMING: PauseState.ACTIVE,
}
