"""What no stream of messages can make the arbiter exceed: open files and log lines.

Every kernel holds a connection, so the arbiter's open files grow with its clients: a
host's default of 1,024 descriptors was used up by 1,100 idle connections of one user,
after which the Hub's reads failed and new kernels ran unarbitrated.
:func:`raise_descriptor_limit` lifts the soft limit to the hard one at start (the
per-user cap on connections, ``ArbiterApp.max_connections_per_user``, keeps one user
from taking them all). Whatever a client makes the arbiter log (a refusal, a decision
per join), :class:`RateLimit` lets at most :data:`BURST` lines of one kind through per
:data:`PERIOD` seconds and counts the rest, so that the log cannot fill a disk.
"""

from __future__ import annotations

import logging
import resource
import threading
import time

#: Lines of one kind let through per :data:`PERIOD` seconds.
BURST = 20
#: Seconds of one window of :class:`RateLimit`.
PERIOD = 10.0
#: The most descriptors asked for where the hard limit is unlimited.
MOST_DESCRIPTORS = 1 << 20


def raise_descriptor_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (at most
    :data:`MOST_DESCRIPTORS`); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = MOST_DESCRIPTORS if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft if soft != resource.RLIM_INFINITY else want
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        return soft
    return want


def pieces_within(descriptors: int | None = None) -> int:
    """Distinct shared pieces the arbiter may hold (:class:`.shared_pieces.SharedPieces`,
    one open memfd each) within ``descriptors`` open files (default: this process's soft
    limit now): half of them, less 1,024 for kernels' connections, logs and ``/proc``
    reads. A node that runs out of descriptors can accept no kernel and read no process,
    so sharing gives way first: past this, offers of new bytes are refused and kernels
    keep their own copies."""
    if descriptors is None:
        descriptors = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if descriptors == resource.RLIM_INFINITY:
            descriptors = MOST_DESCRIPTORS
    return max(0, descriptors // 2 - 1024)


class RateLimit(logging.Filter):
    """A logging filter: at most :data:`BURST` records of one kind (logger, level,
    message template and its first argument: the kind of a decision) per :data:`PERIOD`
    seconds; when a window with dropped records ends, the next record of that kind says
    how many were left out."""

    def __init__(self, burst: int = BURST, period: float = PERIOD):
        super().__init__()
        self.burst, self.period = burst, period
        self._windows: dict[tuple, list] = {}  # kind -> [window start, lines, dropped]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        first = record.args[0] if isinstance(record.args, tuple) and record.args else None
        kind = (record.name, record.levelno, str(record.msg)[:200], str(first)[:100])
        now = time.monotonic()
        with self._lock:
            window = self._windows.get(kind)
            if window is None or now - window[0] >= self.period:
                dropped = window[2] if window is not None else 0
                if len(self._windows) > 10_000:  # kinds are bounded in practice; memory always
                    self._windows.clear()
                self._windows[kind] = [now, 1, 0]
                if dropped:
                    record.msg = f"{record.msg} [{dropped} lines like this one left out in {self.period:g} s]"
                return True
            if window[1] < self.burst:
                window[1] += 1
                return True
            window[2] += 1
            return False
