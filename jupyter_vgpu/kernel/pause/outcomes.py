"""What a pause or resume of the :class:`~.engine.PauseEngine` says: its figures
(:class:`Outcome`) and its errors (:class:`PauseError`, :class:`ResumeError`), shared by
the engine of one device and the :class:`~.devices.DevicesEngine` of several."""

from __future__ import annotations

import dataclasses


class PauseError(RuntimeError):
    """A pause was refused or failed (or a move to the disk tier was refused); the
    message says why.

    Attributes:
        still_paused: False (the rule): nothing was paused, or what a failed pause had
            paused was resumed, and the kernel runs on as before. True when undoing a
            failed pause failed too: the engine stays ``paused``, every byte it had
            released kept on the host (:attr:`.engine.PauseEngine.paused_bytes` of device memory),
            and a :meth:`.engine.PauseEngine.resume` brings them back.
    """

    def __init__(self, message: str, *, still_paused: bool = False):
        super().__init__(message)
        self.still_paused = still_paused


class ResumeError(RuntimeError):
    """A resume failed on damaged or unreadable host data; the kernel stays paused and
    its host copy is untouched (the message names the damaged chunk).

    Attributes:
        paused_bytes: device memory still paused, which a resume needs back, bytes.
        host_bytes: stored bytes kept for it, in host memory or the disk tier.
    """

    def __init__(self, message: str, *, paused_bytes: int, host_bytes: int):
        super().__init__(message)
        self.paused_bytes = paused_bytes
        self.host_bytes = host_bytes


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one pause or resume did.

    Attributes:
        seconds: how long it took, wall clock.
        segment_bytes: device memory released (pause) or taken back (resume), bytes.
        live_bytes: bytes that held data and were saved or written back.
        host_bytes: bytes the host holds for them (compressed).
        codecs: the codec paths used, e.g. ``("nvCOMP 6.0.0 ANS (GPU)",)``.
    """

    seconds: float
    segment_bytes: int
    live_bytes: int
    host_bytes: int
    codecs: tuple[str, ...]

    @property
    def ratio(self) -> float | None:
        """Live bytes over host bytes (None when nothing was stored)."""
        return self.live_bytes / self.host_bytes if self.host_bytes else None
